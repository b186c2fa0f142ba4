"""The FLUX.2 [klein] flow transformer (4B / 9B): double-stream and single-stream blocks.

Module attributes follow the BFL checkpoint names (`img_attn.qkv`, `linear1`, `final_layer.adaLN_modulation.1`,
...): the fused projections are fewer, bigger matmuls, and BFL files load as they are. diffusers folders
are converted by `sanitize_flux2_klein_weights` (q/k/v rows concatenated, final-layer halves swapped).

Shapes: B batch, Lt text tokens (512 in the pipeline), Li image tokens (target + references),
D hidden size, H heads, hd head dim (128), M MLP width (3·D).
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

from ...errors import FluxKleinError
from ..attention import attend
from ..blocks import LastLayer, MLPEmbedder, Modulation, QKNorm, count_blocks, modulate, swiglu, timestep_embedding
from ..config import flux1_marker
from ..kv_cache import KV, ReferenceKV
from ..recompute import checkpointed
from ..rope import apply_rope, rope_tables
from .config import DEV_HIDDEN, DEV_MARKERS, FLUX1_BLOCKS, FLUX1_IMG_IN, FluxKleinParams

# --- building blocks ---------------------------------------------------------------------------------


def linear_part(layer: nn.Module, x: mx.array, rows: slice = slice(None), cols: tuple = (0, None)) -> mx.array:
    """x @ W[rows, c0:c1].T for an nn.Linear or nn.QuantizedLinear with weight (out, in), no bias.

    Lets a fused projection be applied piece by piece without copying it. For a quantized layer
    the column bounds must fall on group boundaries (D = 3072 does for every group size). A layer
    with a `side_path` (the LoRA layer, lora/layers.py) adds its share of the same piece.
    """
    c0, c1 = cols
    if "scales" in layer:  # packed weights: an nn.QuantizedLinear, or the LoRA layer over one
        per_word, g = 32 // layer.bits, layer.group_size  # packed values per uint32, group size

        def part(a, per):
            return a[rows, c0 // per : None if c1 is None else c1 // per]

        out = mx.quantized_matmul(
            x,
            part(layer.weight, per_word),
            part(layer.scales, g),
            part(layer.biases, g),
            transpose=True,
            group_size=g,
            bits=layer.bits,
        )
    else:
        out = x @ layer.weight[rows, c0:c1].T
    side = getattr(layer, "side_path", None)
    return out if side is None else out + side(x, rows, cols)


class SwiGLU(nn.Module):
    """Parameter-free middle element of the MLP lists, so their Linears sit at BFL's indices 0 and 2."""

    def __call__(self, x: mx.array) -> mx.array:
        return swiglu(x)


class SelfAttention(nn.Module):
    """One stream's attention weights in a double block: fused qkv, QK norm, output projection."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.norm = QKNorm(dim // num_heads, eps)
        self.proj = nn.Linear(dim, dim, bias=False)

    def qkv_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.norm(self.qkv(x), self.num_heads)


def _mlp(dim: int, hidden: int) -> list[nn.Module]:
    return [nn.Linear(dim, 2 * hidden, bias=False), SwiGLU(), nn.Linear(hidden, dim, bias=False)]


def _run(layers: list[nn.Module], x: mx.array) -> mx.array:
    for layer in layers:
        x = layer(x)
    return x


class DoubleStreamBlock(nn.Module):
    """Separate weights for image and text, one joint attention over [txt ; img]."""

    def __init__(self, p: FluxKleinParams):
        super().__init__()
        self.eps = p.eps
        self.img_attn = SelfAttention(p.hidden_size, p.num_heads, p.eps)
        self.img_mlp = _mlp(p.hidden_size, p.mlp_hidden)
        self.txt_attn = SelfAttention(p.hidden_size, p.num_heads, p.eps)
        self.txt_mlp = _mlp(p.hidden_size, p.mlp_hidden)

    def __call__(self, img, txt, mod_img, mod_txt, cos, sin, ref_kv: KV | None = None):
        # mod_*: shift, scale, gate of the attention, then of the MLP, each (B, 1, D)
        img_qkv = self.img_attn.qkv_heads(modulate(img, *mod_img[:2], self.eps))
        txt_qkv = self.txt_attn.qkv_heads(modulate(txt, *mod_txt[:2], self.eps))
        Lt = txt.shape[1]
        # Joint sequence is text first: q, k, v each (B, H, Lt + Li, hd)
        q, k, v = (mx.concatenate([t, i], axis=2) for t, i in zip(txt_qkv, img_qkv, strict=True))
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, ref_kv)
        img = self._residuals(img, out[:, Lt:], self.img_attn, self.img_mlp, mod_img)
        return img, self._residuals(txt, out[:, :Lt], self.txt_attn, self.txt_mlp, mod_txt)

    def _residuals(self, x, attn_out, attn: SelfAttention, mlp: list[nn.Module], mod) -> mx.array:
        """One stream after attention: + gated output projection, then + gated MLP."""
        g1, sh2, sc2, g2 = mod[2:]
        x = x + g1 * attn.proj(attn_out)
        return x + g2 * _run(mlp, modulate(x, sh2, sc2, self.eps))

    def reference(self, ref, mod_ref, cos, sin) -> tuple[mx.array, KV]:
        """Reference tokens (B, Lr, D) alone through the image stream, attending only to themselves
        (KV variant): (updated tokens, their rotated (k, v)). `cos`/`sin` cover the Lr tokens."""
        q, k, v = self.img_attn.qkv_heads(modulate(ref, *mod_ref[:2], self.eps))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self._residuals(ref, attend(q, k, v), self.img_attn, self.img_mlp, mod_ref), (k, v)


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP over the joint sequence with one fused input projection."""

    def __init__(self, p: FluxKleinParams):
        super().__init__()
        self.eps = p.eps
        self.num_heads = p.num_heads
        self.hidden_size = p.hidden_size
        # output columns [q | k | v | a | b]
        self.linear1 = nn.Linear(p.hidden_size, 3 * p.hidden_size + 2 * p.mlp_hidden, bias=False)
        self.linear2 = nn.Linear(p.hidden_size + p.mlp_hidden, p.hidden_size, bias=False)
        self.norm = QKNorm(p.head_dim, p.eps)

    def __call__(self, x, mod, cos, sin, low_memory: bool = False, ref_kv: KV | None = None):
        shift, scale, gate = mod
        y = modulate(x, shift, scale, self.eps)
        if low_memory:
            return x + gate * self._halves(y, cos, sin, ref_kv)[0]
        z = self.linear1(y)
        qkv, mlp = z[..., : 3 * self.hidden_size], z[..., 3 * self.hidden_size :]
        q, k, v = self.norm(qkv, self.num_heads)
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, ref_kv)
        return x + gate * self.linear2(mx.concatenate([out, swiglu(mlp)], axis=-1))

    def _halves(self, y, cos, sin, ref_kv: KV | None = None, evaluate: bool = True) -> tuple[mx.array, KV]:
        """linear2([attn | mlp]) as attention half, evaluated, then MLP half: the same sum, but
        neither the (L, 3D + 2M) projection nor the (L, D + M) concatenation is ever alive.
        Also returns the rotated (k, v) of these tokens (the reference pass caches them)."""
        D = self.hidden_size
        q, k, v = self.norm(linear_part(self.linear1, y, rows=slice(0, 3 * D)), self.num_heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        h = linear_part(self.linear2, attend(q, k, v, ref_kv), cols=(0, D))
        if evaluate:
            mx.eval(h, k, v)
        mlp = swiglu(linear_part(self.linear1, y, rows=slice(3 * D, None)))  # (B, L, M)
        return h + linear_part(self.linear2, mlp, cols=(D, None)), (k, v)

    def reference(self, x, mod, cos, sin, low_memory: bool = False) -> tuple[mx.array, KV]:
        """Reference tokens (B, Lr, D) alone, attending only to themselves (KV variant):
        (updated tokens, their rotated (k, v)). Computed in halves; MLX computes the MLP half
        only if the returned tokens are used (not after the last block)."""
        shift, scale, gate = mod
        h, kv = self._halves(modulate(x, shift, scale, self.eps), cos, sin, evaluate=low_memory)
        return x + gate * h, kv


# --- the model ---------------------------------------------------------------------------------------


class FluxKlein(nn.Module):
    """FLUX.2 [klein] transformer: `model(img, txt, timesteps, img_ids, txt_ids)` -> velocity."""

    def __init__(self, params: FluxKleinParams):
        super().__init__()
        self.params = params
        D = params.hidden_size
        self.img_in = nn.Linear(params.in_channels, D, bias=False)
        self.txt_in = nn.Linear(params.context_in_dim, D, bias=False)
        self.time_in = MLPEmbedder(params.time_channels, D)
        self.double_stream_modulation_img = Modulation(D, 6)
        self.double_stream_modulation_txt = Modulation(D, 6)
        self.single_stream_modulation = Modulation(D, 3)
        self.double_blocks = [DoubleStreamBlock(params) for _ in range(params.depth)]
        self.single_blocks = [SingleStreamBlock(params) for _ in range(params.depth_single)]
        self.final_layer = LastLayer(params)

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype: that of the (never quantized) QK-norm scales."""
        block = self.double_blocks[0].img_attn if self.double_blocks else self.single_blocks[0]
        return block.norm.query_norm.scale.dtype

    def compute_rope(self, txt_ids: mx.array, img_ids: mx.array) -> tuple[mx.array, mx.array]:
        """cos/sin tables (Lt + Li, hd/2) for the joint [txt ; img] sequence; build once per shape."""
        ids = mx.concatenate([i[0] if i.ndim == 3 else i for i in (txt_ids, img_ids)], axis=0)  # (Lt + Li, 4)
        return rope_tables(ids, self.params.axes_dim, self.params.theta)

    def embed_text(self, txt: mx.array) -> mx.array:
        """The step-invariant text projection (B, Lt, context_in_dim) -> (B, Lt, D)."""
        return self.txt_in(txt.astype(self.dtype))

    def forward_with_rope(
        self,
        img: mx.array,
        txt: mx.array | None,
        timesteps: mx.array,
        rope: tuple[mx.array, mx.array],
        txt_embedded: mx.array | None = None,
        low_memory: bool = False,
        reference_kv: ReferenceKV | None = None,
        checkpoint: bool = False,
    ) -> mx.array:
        """The forward pass with precomputed `rope` tables (and optionally `txt_embedded = embed_text(txt)`).

        img (B, Li, in_channels), txt (B, Lt, context_in_dim), timesteps (B,) or scalar sigma in [0, 1].
        Returns (B, Li, in_channels) in the weight dtype. `low_memory` evaluates after every block
        (otherwise MLX keeps the intermediates of several blocks alive at once) and runs single
        blocks in two halves: the same function with a lower activation peak (about 1.3 -> 0.8 GB
        for klein-4B at 1024^2), at the cost of one synchronisation per block.
        `reference_kv` (KV variant, from `reference_kv()`): every text and image token also attends
        to the cached reference keys/values; `img` then holds the target tokens only.
        `checkpoint` (training, under `mx.grad`): gradient checkpointing per block, each block's
        inner activations recomputed in the backward pass instead of kept (`low_memory` evaluates
        inside the forward, which a differentiated function cannot do).
        """
        if checkpoint and (low_memory or reference_kv is not None):
            raise ValueError("checkpoint is for training: it excludes low_memory and reference_kv")
        dtype = self.dtype
        cos, sin = rope
        txt = self.embed_text(txt) if txt_embedded is None else txt_embedded.astype(dtype)
        img = self.img_in(img.astype(dtype))
        B, Lt = txt.shape[0], txt.shape[1]
        if cos.shape[0] != Lt + img.shape[1]:
            raise ValueError(
                f"RoPE tables cover {cos.shape[0]} tokens but the sequence has {Lt} text + {img.shape[1]} image"
            )
        timesteps = timesteps if isinstance(timesteps, mx.array) else mx.array(timesteps, dtype=mx.float32)
        timesteps = mx.broadcast_to(timesteps.reshape(-1), (B,))
        vec = self.time_in(timestep_embedding(timesteps, self.params.time_channels).astype(dtype))  # (B, D)
        # The three modulations are shared by every block of their kind.
        mod_img = self.double_stream_modulation_img(vec)
        mod_txt = self.double_stream_modulation_txt(vec)
        mod_single = self.single_stream_modulation(vec)
        refs = reference_kv or ReferenceKV([None] * len(self.double_blocks), [None] * len(self.single_blocks))
        for block, ref_kv in zip(self.double_blocks, refs.double, strict=True):
            if checkpoint:
                img, txt = checkpointed(block)(img, txt, mod_img, mod_txt, cos, sin)
            else:
                img, txt = block(img, txt, mod_img, mod_txt, cos, sin, ref_kv)
            if low_memory:
                mx.eval(img, txt)
        h = mx.concatenate([txt, img], axis=1)  # (B, Lt + Li, D)
        for block, ref_kv in zip(self.single_blocks, refs.single, strict=True):
            if checkpoint:
                h = checkpointed(block)(h, mod_single, cos, sin)
            else:
                h = block(h, mod_single, cos, sin, low_memory, ref_kv)
            if low_memory:
                mx.eval(h)
        return self.final_layer(h[:, Lt:], vec)

    def reference_kv(self, ref: mx.array, ref_ids: mx.array, low_memory: bool = False) -> ReferenceKV:
        """The KV variant's first-step reference pass: every block's rotated keys/values of `ref`.

        ref (B, Lr, in_channels): the packed reference latents of all references; ref_ids (Lr, 4)
        their positions (t = 10, 20, ...). The reference tokens attend only to themselves and are
        modulated at timestep 0, as klein 9B-KV was distilled (diffusers' `kv_cache_mode="extract"`),
        so the result does not depend on prompt, noise or step: compute it once per image and pass
        it to every `forward_with_rope(..., reference_kv=...)`. Returned unevaluated unless `low_memory`
        (then evaluated block by block).
        """
        dtype = self.dtype
        cos, sin = rope_tables(ref_ids, self.params.axes_dim, self.params.theta)  # (Lr, hd/2)
        x = self.img_in(ref.astype(dtype))  # (B, Lr, D)
        t0 = mx.zeros((x.shape[0],), dtype=mx.float32)  # the fixed reference timestep
        vec = self.time_in(timestep_embedding(t0, self.params.time_channels).astype(dtype))
        mod_img, mod_single = self.double_stream_modulation_img(vec), self.single_stream_modulation(vec)
        cache = ReferenceKV()
        for block in self.double_blocks:
            x, kv = block.reference(x, mod_img, cos, sin)
            cache.double.append(kv)
            if low_memory:
                mx.eval(x, kv)
        for n, block in enumerate(self.single_blocks):
            x, kv = block.reference(x, mod_single, cos, sin, low_memory)
            cache.single.append(kv)
            if low_memory:
                # the last block's tokens are never needed, only its keys/values
                mx.eval(kv if n == len(self.single_blocks) - 1 else (x, kv))
        return cache

    def __call__(
        self, img: mx.array, txt: mx.array, timesteps: mx.array, img_ids: mx.array, txt_ids: mx.array
    ) -> mx.array:
        return self.forward_with_rope(img, txt, timesteps, self.compute_rope(txt_ids, img_ids))


def linear_shapes(params: FluxKleinParams) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear of a klein transformer with `params`, by module path.

    Read off a model built lazily (its random initial weights are never evaluated, so this allocates
    nothing): the one statement of the layers' shapes is the model's own constructor.
    """
    model = FluxKlein(params)
    return {path: tuple(m.weight.shape) for path, m in model.named_modules() if isinstance(m, nn.Linear)}


# --- checkpoints -------------------------------------------------------------------------------------

# diffusers name -> ours (BFL), applied to whole dotted segments; q/k/v and the final layer are special.
DIFFUSERS_TOP = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
DIFFUSERS_DOUBLE = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
DIFFUSERS_SINGLE = {
    "attn.to_qkv_mlp_proj": "linear1",
    "attn.to_out": "linear2",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}
QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}  # fmt: skip


def _reject_foreign(weights: dict[str, mx.array]) -> None:
    """Raise for FLUX.1 and FLUX.2-dev checkpoints, which share many names with klein."""
    n_double = max(count_blocks(weights, "double_blocks"), count_blocks(weights, "transformer_blocks"))
    n_single = max(count_blocks(weights, "single_blocks"), count_blocks(weights, "single_transformer_blocks"))
    img_in = weights.get("img_in.weight", weights.get("x_embedder.weight"))
    flux1_key = next((k for k in weights if flux1_marker(k)), None)
    dev_key = next((k for k in weights if any(m in k for m in DEV_MARKERS)), None)
    flux1_shape = img_in is not None and tuple(img_in.shape) == FLUX1_IMG_IN
    blocks = f"{n_double} double / {n_single} single blocks"
    if flux1_key or flux1_shape or (n_double, n_single) == FLUX1_BLOCKS:
        why = f"key {flux1_key}" if flux1_key else blocks
        what = f"not a FLUX.2 [klein] checkpoint: it is a FLUX.1 transformer checkpoint ({why})"
    elif dev_key or (img_in is not None and img_in.shape[0] == DEV_HIDDEN):
        why = f"key {dev_key}" if dev_key else f"hidden size {DEV_HIDDEN}"
        what = f"not a klein checkpoint: it is FLUX.2-dev ({why}, {blocks})"
    else:
        return
    raise FluxKleinError(f"{what}; use a FLUX.2 [klein] 4B or 9B transformer")


def _from_diffusers(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    rest = dict(weights)
    # Fused qkv: rows of q, k, v concatenated in that order, for every tensor kind (weight, scales, ...).
    for k in weights:
        for ours, parts in QKV.items():
            if not (m := re.match(rf"transformer_blocks\.(\d+)\.{re.escape(parts[0])}\.(.+)$", k)):
                continue
            names = [f"transformer_blocks.{m[1]}.{p}.{m[2]}" for p in parts]
            if all(name in rest for name in names):
                out[f"double_blocks.{m[1]}.{ours}.{m[2]}"] = mx.concatenate([rest.pop(x) for x in names], axis=0)
    for k, v in rest.items():
        if k.startswith("norm_out.linear."):  # diffusers rows are [scale ; shift], ours [shift ; scale]
            k = "final_layer.adaLN_modulation.1." + k.removeprefix("norm_out.linear.")
            v = mx.concatenate(mx.split(v, 2)[::-1], axis=0)
        out[_rename_diffusers(k)] = v
    return out


def _rename_diffusers(k: str) -> str:
    """Our name for one diffusers key; unknown keys come back unchanged (strict load then names them)."""
    for theirs, ours in DIFFUSERS_TOP.items():
        if k.startswith(theirs + "."):
            return ours + k[len(theirs) :]
    if m := re.match(r"(single_)?transformer_blocks\.(\d+)\.(.+)$", k):
        blocks, table = ("single_blocks", DIFFUSERS_SINGLE) if m[1] else ("double_blocks", DIFFUSERS_DOUBLE)
        rest = m[3]
        for theirs, ours in table.items():
            if rest == theirs or rest.startswith(theirs + "."):
                return f"{blocks}.{m[2]}.{ours}{rest[len(theirs) :]}"
    return k


def sanitize_flux2_klein_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Map a klein transformer checkpoint onto our parameter names.

    Accepts diffusers (`transformer/diffusion_pytorch_model*.safetensors`), BFL single files (optionally
    prefixed `model.diffusion_model.`), and our own naming (= BFL's, also for quantized tensors), which passes
    through. FLUX.1 and FLUX.2-dev checkpoints raise FluxKleinError.
    """
    stripped = {re.sub(r"^(model\.)?diffusion_model\.", "", k): v for k, v in weights.items()}
    _reject_foreign(stripped)
    diffusers_roots = (
        "transformer_blocks.",
        "single_transformer_blocks.",
        "x_embedder.",
        "time_guidance_embed.",
        "norm_out.",
        "proj_out.",
        "context_embedder.",
    )
    return _from_diffusers(stripped) if any(k.startswith(diffusers_roots) for k in stripped) else stripped


def infer_params(weights: dict[str, mx.array]) -> FluxKleinParams:
    """Hyper-parameters implied by sanitized weights' shapes (klein presets when hidden size and depths match)."""
    if "img_in.weight" not in weights:
        raise FluxKleinError(
            "no img_in / x_embedder weight: this is not a FLUX.2 [klein] transformer checkpoint "
            "(is it the text encoder or the VAE?)"
        )
    D = weights["img_in.weight"].shape[0]
    depth, depth_single = count_blocks(weights, "double_blocks"), count_blocks(weights, "single_blocks")
    for preset in (FluxKleinParams.klein_4b(), FluxKleinParams.klein_9b()):
        if (D, depth, depth_single) == (preset.hidden_size, preset.depth, preset.depth_single):
            return preset
    # A custom size: read each dimension from an unquantized weight.
    try:
        if depth:
            hd = weights["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
            mlp_hidden = weights["double_blocks.0.img_mlp.2.weight"].shape[1]
        else:
            hd = weights["single_blocks.0.norm.query_norm.scale"].shape[0]
            mlp_hidden = weights["single_blocks.0.linear2.weight"].shape[1] - D
        return FluxKleinParams(
            in_channels=weights["img_in.weight"].shape[1],
            hidden_size=D,
            context_in_dim=weights["txt_in.weight"].shape[1],
            num_heads=D // hd,
            mlp_ratio=mlp_hidden / D,
            depth=depth,
            depth_single=depth_single,
            axes_dim=(hd // 4,) * 4,
            time_channels=weights["time_in.in_layer.weight"].shape[1],
        )
    except KeyError as e:
        raise FluxKleinError(f"transformer checkpoint is incomplete: missing {e.args[0]}; download it again") from None
