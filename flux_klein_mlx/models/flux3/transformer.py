"""FLUX 3 Image Klein's flow transformer: per-mode blocks, then joint single blocks with per-token modulation.

Three token modes: the noisy image tokens (img), the reference tokens (ref, BFL's "image_cond") and the text
(txt). Each mode first runs through its own stack of `depth` blocks, attending only within itself; then the
joint sequence [txt ; img ; ref] runs through `depth_single` single blocks. Every block is the parallel layout
x + gate · (attn(y) + mlp(y)) with y = (1 + scale) · LN(x) + shift. Image tokens are modulated at the step's
time t, text and reference tokens at t = 0; a flow-map (distilled) model adds the embedding of the target
time to every mode's. Only the image tokens reach the output layer.

Module attributes follow the BFL checkpoint (`content_mode_blocks.image.0.q_proj`, `final_layer.image.linear`,
...), so BFL files and BFL LoRAs load as they are; diffusers folders go through `sanitize_flux3_weights`.
The pieces shared with FLUX.2 (timestep sinusoid, modulation, SwiGLU, QK norm, RoPE, attention, the output
layer, checkpointing) are models/'s (blocks.py, rope.py, attention.py, recompute.py).

Shapes: B batch, Lt text, Li image, Lr reference tokens, D hidden, H heads, hd head dim, M MLP width (3·D).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ...errors import FluxKleinError
from ..attention import attend
from ..blocks import (
    LastLayer,
    MLPEmbedder,
    Modulation,
    QKNorm,
    count_blocks,
    modulate,
    swiglu,
    timestep_embedding,
)
from ..recompute import checkpointed
from ..rope import apply_rope, rope_tables
from .config import Flux3Params

# The modulation heads of each stage, one per token mode (BFL's names).
FLUX3_MODES = ("image", "image_cond", "txt")

RopeTables = tuple[mx.array, mx.array]  # cos, sin, each (L, hd/2) float32


@dataclass
class Flux3Rope:
    """RoPE tables of each mode's tokens and of the joint [txt ; img ; ref] sequence (`ref` None without
    references). They depend only on the ids: build them once per shape with `Flux3.compute_rope`."""

    txt: RopeTables
    img: RopeTables
    ref: RopeTables | None
    joint: RopeTables


class Flux3Block(nn.Module):
    """A parallel block: the per-mode blocks and the single blocks have the same weights and math (a single
    block's LayerNorm and modulation are per token, which the mode-wise split in diffusers also is)."""

    def __init__(self, p: Flux3Params):
        super().__init__()
        D, M = p.hidden_size, p.mlp_hidden
        self.eps, self.num_heads = p.eps, p.num_heads
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.norm = QKNorm(p.head_dim, p.eps)
        self.attn_out = nn.Linear(D, D, bias=False)
        self.mlp_in = nn.Linear(D, 2 * M, bias=False)  # [gate | value] for SwiGLU
        self.mlp_out = nn.Linear(M, D, bias=False)

    def __call__(self, x: mx.array, mod: list[mx.array], cos: mx.array, sin: mx.array) -> mx.array:
        """x (B, L, D); mod = shift, scale, gate, each (B, 1, D) (a mode block) or (B, L, D) (per token)."""
        shift, scale, gate = mod
        y = modulate(x, shift, scale, self.eps)
        out = self.attn_out(self.attention(y, cos, sin)) + self.mlp_out(swiglu(self.mlp_in(y)))
        return x + gate * out

    def attention(self, y: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """Softmax self-attention of y (B, L, D) -> (B, L, D), heads merged, before the output projection."""
        B, L, _ = y.shape

        def heads(layer: nn.Module) -> mx.array:
            return layer(y).reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, hd)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        # QK norm and RoPE in float32, then one cast to the value dtype: BFL and diffusers keep them in fp32
        q = apply_rope(self.norm.query_norm(q.astype(mx.float32)), cos, sin).astype(v.dtype)
        k = apply_rope(self.norm.key_norm(k.astype(mx.float32)), cos, sin).astype(v.dtype)
        return attend(q, k, v)


class Flux3(nn.Module):
    """FLUX 3 Image Klein transformer: `model(img, txt, timesteps, img_ids, txt_ids, ref, ref_ids)` -> velocity."""

    def __init__(self, params: Flux3Params):
        super().__init__()
        self.params = params
        D = params.hidden_size
        self.emb_in = {
            "image": nn.Linear(params.in_channels, D, bias=False),
            "image_cond": nn.Linear(params.cond_in_channels, D, bias=False),
        }
        self.txt_in = nn.Linear(params.context_in_dim, D, bias=False)
        self.time_in = MLPEmbedder(params.time_channels, D)
        if params.flow_map:  # the embedder of the time each step jumps to (BFL's name)
            self.ref_time_in = MLPEmbedder(params.time_channels, D)
        # SiLU(vec) -> Linear(D, 3D) -> shift, scale, gate; each head is shared by every block of its stage
        self.early_stream_modulations = {mode: Modulation(D, 3) for mode in FLUX3_MODES}
        self.single_stream_modulations = {mode: Modulation(D, 3) for mode in FLUX3_MODES}
        self.content_mode_blocks = {mode: [Flux3Block(params) for _ in range(params.depth)] for mode in FLUX3_MODES[:2]}
        self.txt_mode_blocks = [Flux3Block(params) for _ in range(params.depth)]
        self.single_blocks = [Flux3Block(params) for _ in range(params.depth_single)]
        # FLUX.2's output layer (rows [shift ; scale], then D -> in_channels), on the image tokens only
        self.final_layer = {"image": LastLayer(params)}

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype: that of the (never quantized) QK-norm scales."""
        block = (self.single_blocks or self.txt_mode_blocks)[0]
        return block.norm.query_norm.scale.dtype

    def compute_rope(self, txt_ids: mx.array, img_ids: mx.array, ref_ids: mx.array | None = None) -> Flux3Rope:
        """Tables for ids (L, 4) or (B, L, 4) float (element 0 is used); once per shape, not per step."""
        axes, theta = self.params.axes_dim, self.params.theta
        txt, img = rope_tables(txt_ids, axes, theta), rope_tables(img_ids, axes, theta)
        ref = None if ref_ids is None else rope_tables(ref_ids, axes, theta)
        modes = [txt, img] + ([ref] if ref is not None else [])
        joint = tuple(mx.concatenate([m[i] for m in modes], axis=0) for i in range(2))  # (Lt + Li + Lr, hd/2)
        return Flux3Rope(txt=txt, img=img, ref=ref, joint=joint)

    def embed_text(self, txt: mx.array) -> mx.array:
        """The text projection (B, Lt, context_in_dim) -> (B, Lt, D)."""
        return self.txt_in(txt.astype(self.dtype))

    def early_text(self, txt: mx.array, rope: Flux3Rope) -> mx.array:
        """Base only: the text tokens after their mode blocks (B, Lt, D). They sit at t = 0 whatever the step,
        so one run serves every step (pass it as `txt_early`)."""
        zero = self._base_zero(txt.shape[0])
        mod = self.early_stream_modulations["txt"](zero)
        return self._stack(self.txt_mode_blocks, self.embed_text(txt), mod, rope.txt)

    def early_references(self, ref: mx.array, rope: Flux3Rope) -> mx.array:
        """Base only: the reference tokens (B, Lr, cond_in_channels) after their mode blocks (B, Lr, D), at
        t = 0 whatever the step (pass it as `ref_early`)."""
        zero = self._base_zero(ref.shape[0])
        x = self.emb_in["image_cond"](ref.astype(self.dtype))
        mod = self.early_stream_modulations["image_cond"](zero)
        return self._stack(self.content_mode_blocks["image_cond"], x, mod, rope.ref)

    def forward_with_rope(
        self,
        img: mx.array,
        txt: mx.array | None,
        timesteps: mx.array,
        rope: Flux3Rope,
        *,
        ref: mx.array | None = None,
        target_timesteps: mx.array | None = None,
        txt_early: mx.array | None = None,
        ref_early: mx.array | None = None,
        low_memory: bool = False,
        checkpoint: bool = False,
    ) -> mx.array:
        """The forward pass with precomputed `rope` -> the image tokens' velocity (B, Li, in_channels), in the
        weight dtype.

        img (B, Li, in_channels) target tokens; txt (B, Lt, context_in_dim) (None with `txt_early`); ref
        (B, Lr, cond_in_channels) or None; timesteps (B,) float32 sigma in [0, 1] (cast to the model dtype and
        scaled by 1000 there, as diffusers does); target_timesteps (B,) the sigma this step jumps to, on a
        flow-map model only. txt_early / ref_early: `early_text` / `early_references` (Base only). `low_memory`
        evaluates after every block; `checkpoint` (training under `mx.grad`) recomputes each block's inner
        activations in the backward pass.
        """
        if checkpoint and low_memory:
            raise ValueError("checkpoint is for training: it excludes low_memory")
        if self.params.flow_map and (txt_early is not None or ref_early is not None):
            raise ValueError("txt_early / ref_early are for Base: a flow-map model's target time changes them")
        refs = ref if ref_early is None else ref_early
        if (refs is None) != (rope.ref is None):
            raise ValueError("reference tokens and reference RoPE tables (ref_ids) go together")
        check_rope_lengths(rope, {"text": txt if txt_early is None else txt_early, "image": img, "reference": refs})
        dtype = self.dtype
        img = self.emb_in["image"](img.astype(dtype))
        vec, zero = self.time_vectors(timesteps, target_timesteps, img.shape[0])  # (B, D) each
        run = partial(self._stack, low_memory=low_memory, checkpoint=checkpoint)
        early = self.early_stream_modulations
        if txt_early is None:
            txt_early = run(self.txt_mode_blocks, self.embed_text(txt), early["txt"](zero), rope.txt)
        img = run(self.content_mode_blocks["image"], img, early["image"](vec), rope.img)
        if ref is not None and ref_early is None:
            x = self.emb_in["image_cond"](ref.astype(dtype))
            ref_early = run(self.content_mode_blocks["image_cond"], x, early["image_cond"](zero), rope.ref)
        parts = [(txt_early.astype(dtype), "txt", zero), (img, "image", vec)]
        parts += [] if ref_early is None else [(ref_early.astype(dtype), "image_cond", zero)]
        h = mx.concatenate([x for x, _, _ in parts], axis=1)  # (B, Lt + Li + Lr, D)
        h = run(self.single_blocks, h, self.single_modulation(parts), rope.joint)
        Lt = txt_early.shape[1]
        return self.final_layer["image"](h[:, Lt : Lt + img.shape[1]], vec)

    def time_vectors(self, timesteps, target_timesteps, batch: int) -> tuple[mx.array, mx.array]:
        """(image vector, text/reference vector), each (B, D): `time_in` of t and of 0, plus on a flow-map
        model `ref_time_in` of the target time in both (diffusers adds it to every mode's embedding)."""
        if (target_timesteps is not None) != self.params.flow_map:
            raise ValueError("target_timesteps is required by, and only by, a flow-map (distilled) FLUX 3 model")
        vec = self._embed_time(self.time_in, timesteps, batch)
        zero = self._embed_time(self.time_in, mx.zeros((batch,), dtype=mx.float32), batch)
        if target_timesteps is not None:
            target = self._embed_time(self.ref_time_in, target_timesteps, batch)
            vec, zero = vec + target, zero + target
        return vec, zero

    def _embed_time(self, embedder: MLPEmbedder, sigmas, batch: int) -> mx.array:
        """sigma (B,) or scalar -> (B, D). diffusers casts sigma to the model dtype and multiplies by 1000 in
        that dtype (in bf16, 0.7 is 0.69921875 and x 1000 rounds to 700); the sinusoid itself is float32."""
        dtype = self.dtype
        sigmas = sigmas if isinstance(sigmas, mx.array) else mx.array(sigmas, dtype=mx.float32)
        sigmas = mx.broadcast_to(sigmas.reshape(-1), (batch,))
        sinusoid = timestep_embedding(sigmas.astype(dtype) * 1000, self.params.time_channels, scale=1.0)
        return embedder(sinusoid.astype(dtype))

    def _base_zero(self, batch: int) -> mx.array:
        """The t = 0 vector (B, D) of the text and the references, which only Base keeps step-invariant."""
        if self.params.flow_map:
            raise ValueError("early_text / early_references are for Base: a flow-map model's target time changes them")
        return self.time_vectors(mx.zeros((batch,), dtype=mx.float32), None, batch)[1]

    def single_modulation(self, parts) -> list[mx.array]:
        """shift, scale, gate, each (B, Lt + Li + Lr, D): every token takes its own mode's single-stream head.
        `parts`: (tokens (B, L, D), mode, vector (B, D)) in joint order."""
        heads = [self.single_stream_modulations[mode](vec) for _, mode, vec in parts]  # each 3 x (B, 1, D)
        return [
            mx.concatenate([mx.broadcast_to(h[i], x.shape) for h, (x, _, _) in zip(heads, parts, strict=True)], axis=1)
            for i in range(3)
        ]

    @staticmethod
    def _stack(blocks, x, mod, rope: RopeTables, low_memory: bool = False, checkpoint: bool = False) -> mx.array:
        """x (B, L, D) through `blocks`, each with the same modulation `mod` and tables `rope`."""
        cos, sin = rope
        for block in blocks:
            x = checkpointed(block)(x, mod, cos, sin) if checkpoint else block(x, mod, cos, sin)
            if low_memory:
                mx.eval(x)
        return x

    def __call__(self, img, txt, timesteps, img_ids, txt_ids, ref=None, ref_ids=None, target_timesteps=None):
        """The forward pass with ids (L, 4) float (diffusers' signature, less `attention_kwargs`)."""
        if (ref is None) != (ref_ids is None):
            raise ValueError("ref and ref_ids go together")
        rope = self.compute_rope(txt_ids, img_ids, ref_ids)
        return self.forward_with_rope(img, txt, timesteps, rope, ref=ref, target_timesteps=target_timesteps)


def check_rope_lengths(rope: Flux3Rope, tokens: dict[str, mx.array | None]) -> None:
    """Each mode's tokens (B, L, .) against its RoPE table: a mismatch is named, not a broadcast error."""
    for (mode, x), table in zip(tokens.items(), (rope.txt, rope.img, rope.ref), strict=True):
        if x is not None and table is not None and table[0].shape[0] != x.shape[1]:
            raise ValueError(f"RoPE tables cover {table[0].shape[0]} {mode} tokens but there are {x.shape[1]}")


def linear_shapes(params: Flux3Params) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear of a FLUX 3 transformer with `params`, by module path (BFL names).

    Read off a model built lazily (its random initial weights are never evaluated, so this allocates nothing).
    """
    model = Flux3(params)
    return {path: tuple(m.weight.shape) for path, m in model.named_modules() if isinstance(m, nn.Linear)}


# --- checkpoints -------------------------------------------------------------------------------------

# diffusers module path -> ours (BFL's), matched on whole leading segments. The one table of FLUX 3's names:
# the sanitizer reads it forwards, the LoRA readers either way. norm_out's rows are [scale ; shift] in
# diffusers, [shift ; scale] in ours (the sanitizer swaps the halves).
FLUX3_DIFFUSERS_TOP = {
    "x_embedders.image": "emb_in.image",
    "x_embedders.image_cond": "emb_in.image_cond",
    "context_embedder": "txt_in",
    "timestep_embedder.linear_1": "time_in.in_layer",
    "timestep_embedder.linear_2": "time_in.out_layer",
    "target_timestep_embedder.linear_1": "ref_time_in.in_layer",
    "target_timestep_embedder.linear_2": "ref_time_in.out_layer",
    "norm_out.linear": "final_layer.image.adaLN_modulation.1",
    "proj_out": "final_layer.image.linear",
    **{
        f"{stage}_stream_modulations.{mode}.linear": f"{stage}_stream_modulations.{mode}.lin"
        for stage in ("early", "single")
        for mode in FLUX3_MODES
    },
}
# the block stacks: diffusers prefix -> ours; block N keeps its index
FLUX3_DIFFUSERS_STACKS = {
    "mode_blocks.image": "content_mode_blocks.image",
    "mode_blocks.image_cond": "content_mode_blocks.image_cond",
    "txt_mode_blocks": "txt_mode_blocks",
    "single_transformer_blocks": "single_blocks",
}
# inside a block: diffusers path -> ours (the QK-norm weights are parameters, renamed whole)
FLUX3_DIFFUSERS_BLOCK = {
    "attn.to_q": "q_proj",
    "attn.to_k": "k_proj",
    "attn.to_v": "v_proj",
    "attn.to_out.0": "attn_out",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
    "ff.linear_in": "mlp_in",
    "ff.linear_out": "mlp_out",
}
# `model.diffusion_model.` (ComfyUI) / `diffusion_model.` prefixes of BFL-named files
BFL_PREFIX = re.compile(r"^(model\.)?diffusion_model\.")


def _replace_head(name: str, table: dict[str, str]) -> str | None:
    """`name` with its leading whole segments renamed by `table` (the longest match), or None."""
    for theirs in sorted(table, key=len, reverse=True):
        if name == theirs or name.startswith(theirs + "."):
            return table[theirs] + name[len(theirs) :]
    return None


def _rename(key: str, top: dict[str, str], stacks: dict[str, str], block: dict[str, str]) -> str:
    """`key` renamed by one direction of the three tables; a name they do not cover comes back unchanged."""
    if (renamed := _replace_head(key, top)) is not None:
        return renamed
    for old, new in stacks.items():
        if m := re.match(rf"{re.escape(old)}\.(\d+)\.(.+)$", key):
            inner = _replace_head(m[2], block)
            return f"{new}.{m[1]}.{m[2] if inner is None else inner}"
    return key


def flux3_name(key: str) -> str:
    """Our (BFL) name for a diffusers FLUX 3 module path or tensor key; any other name comes back unchanged
    (BFL names pass through, and a strict load then names what is unknown)."""
    return _rename(key, FLUX3_DIFFUSERS_TOP, FLUX3_DIFFUSERS_STACKS, FLUX3_DIFFUSERS_BLOCK)


def flux3_diffusers_name(key: str) -> str:
    """The inverse of `flux3_name`: diffusers' name for one of our module paths or tensor keys."""
    tables = (FLUX3_DIFFUSERS_TOP, FLUX3_DIFFUSERS_STACKS, FLUX3_DIFFUSERS_BLOCK)
    return _rename(key, *({ours: theirs for theirs, ours in t.items()} for t in tables))


def sanitize_flux3_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Map a FLUX 3 transformer checkpoint onto our (BFL) names.

    Accepts diffusers (`transformer/diffusion_pytorch_model*.safetensors`), BFL single files (optionally
    prefixed `model.diffusion_model.` or `diffusion_model.`) and our own naming (quantized tensors too), which
    passes through. BFL's training-only `repa_projectors.*` are dropped.
    """
    out = {}
    for key, value in weights.items():
        key = BFL_PREFIX.sub("", key)
        if key.startswith("repa_projectors."):
            continue
        if key.startswith("norm_out.linear."):  # [scale ; shift] rows -> [shift ; scale], every tensor kind
            value = mx.concatenate(mx.split(value, 2)[::-1], axis=0)
        out[flux3_name(key)] = value
    return out


def infer_flux3_params(weights: dict[str, mx.array]) -> Flux3Params:
    """Hyper-parameters implied by sanitized weights' shapes; `flow_map` from `ref_time_in`'s presence.

    The released sizes are recognised by hidden size and depths (a quantized file then needs nothing else);
    a custom size reads each dimension from unquantized weights.
    """
    if "emb_in.image.weight" not in weights:
        raise FluxKleinError(
            "no emb_in.image / x_embedders.image weight: this is not a FLUX 3 Image Klein transformer checkpoint"
        )
    D = weights["emb_in.image.weight"].shape[0]
    depth, depth_single = count_blocks(weights, "txt_mode_blocks"), count_blocks(weights, "single_blocks")
    flow_map = "ref_time_in.in_layer.weight" in weights
    released = Flux3Params(flow_map=flow_map)
    if (D, depth, depth_single) == (released.hidden_size, released.depth, released.depth_single):
        return released
    try:
        block = "single_blocks.0" if depth_single else "txt_mode_blocks.0"
        hd = weights[f"{block}.norm.query_norm.scale"].shape[0]
        return Flux3Params(
            in_channels=weights["final_layer.image.linear.weight"].shape[0],
            cond_in_channels=weights["emb_in.image_cond.weight"].shape[1],
            hidden_size=D,
            num_heads=D // hd,
            context_in_dim=weights["txt_in.weight"].shape[1],
            mlp_ratio=weights[f"{block}.mlp_in.weight"].shape[0] / (2 * D),
            depth=depth,
            depth_single=depth_single,
            axes_dim=(hd // 4,) * 4,
            time_channels=weights["time_in.in_layer.weight"].shape[1],
            flow_map=flow_map,
        )
    except KeyError as e:
        raise FluxKleinError(
            f"FLUX 3 transformer checkpoint is incomplete: missing {e.args[0]}; download it again"
        ) from None
