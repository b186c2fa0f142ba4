"""Each family's tiny transformer and its diffusers judge, for the transformer tests written once for both
families (tests/models/test_transformer.py; the kit's `transformer`).

A twin gives, for its family: the tiny diffusers references (`reference(variant)`, random weights on every
parameter), the inputs its pipeline builds (latents, text, and the pipeline's own position ids), diffusers'
and our forward on them, its BFL names (checked by diffusers' own BFL converter), the released sizes and the
float32 tolerance. FLUX.2 [klein] puts reference tokens after the target's in one image stream (RoPE time
10, 20, ...); FLUX 3 Image Klein has a reference stream of its own (l = -1, -2, ...) and, distilled, a target
timestep (the flow map).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np
import torch
from refs import load_one, randomize_, to_mx

from flux_klein_mlx.family import FAMILIES
from flux_klein_mlx.models.rope import image_ids, text_ids
from flux_klein_mlx.storage.weights import load_into

LT = 7  # text tokens: the models must not assume 512 (FLUX.2) or a multiple of 80 (FLUX 3)


class Inputs(NamedTuple):
    img: torch.Tensor  # (B, L, C): FLUX.2 the target's tokens then the references', FLUX 3 the target's
    txt: torch.Tensor  # (B, LT, ctx)
    img_ids: torch.Tensor  # the pipeline's own ids of `img`
    txt_ids: torch.Tensor
    ref: torch.Tensor | None  # FLUX 3's reference tokens (B, Lr, C), FLUX.2: None
    ref_ids: torch.Tensor | None
    grid: tuple[int, int]
    refs: list[tuple[int, int]]  # the references' token grids


def _mx(x):
    return None if x is None else to_mx(x)


def load_weights(family: str, weights: dict[str, mx.array], dtype=None):
    """Our model from sanitized weights through the real steps: params from the shapes, strict load."""
    fam = FAMILIES[family]
    model = fam.build_transformer(fam.infer_params(weights))
    load_into(model, weights, "transformer", dtype=dtype)
    return model


def reference_bf16(reference, folder):
    """diffusers' bf16 model as `from_pretrained(torch_dtype=bfloat16)` makes it (modules kept in fp32 kept),
    from the reference's weights rounded to bf16 (as released); the reference itself takes those weights."""
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.bfloat16())
    reference.save_pretrained(folder)
    return type(reference).from_pretrained(folder, torch_dtype=torch.bfloat16).eval()


class Flux2Transformers:
    """FLUX.2 [klein]'s transformer against diffusers' Flux2Transformer2DModel."""

    family = "flux2"
    # Tiny diffusers config: 3 heads of 16 (axes 4x4), 2 double + 2 single blocks, text width 24.
    CONFIG = dict(patch_size=1, in_channels=16, out_channels=None, num_layers=2, num_single_layers=2,
                  attention_head_dim=16, num_attention_heads=3, joint_attention_dim=24, mlp_ratio=3.0,
                  timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6,
                  guidance_embeds=False)  # fmt: skip
    # g64: hidden 64 (the tiny snapshot's sizes, with a text width of 24): every Linear but the text input has an
    # input width that is a multiple of 32
    CONFIGS = {"tiny": CONFIG, "g64": dict(CONFIG, in_channels=32, attention_head_dim=32, num_attention_heads=2,
                                          axes_dims_rope=(8, 8, 8, 8))}  # fmt: skip
    variants = ("tiny",)  # the parity tests' models
    cases = [  # (B, grid, references, t, target t)
        (2, (3, 5), [], [1.0, 1.0], None),
        (2, (3, 5), [(2, 3)], [0.7, 0.7], None),
        (2, (5, 3), [(2, 3), (4, 2)], [0.3, 0.9], None),
        (1, (4, 4), [(3, 2), (2, 2)], [0.05], None),
    ]
    tolerance = 1e-4
    cached_variant, cached_tolerance = "tiny", 0.0  # the hoisted text path is bit-exact
    quantization = [(4, 32, "g64"), (8, 32, "g64")]  # (bits, group size, variant)
    quantized_layer, float_layer = "single_blocks.0.linear2", "txt_in"  # quantized / too narrow for a group
    bf16_variant, bf16_apart = "tiny", 1e-3  # diffusers' own bf16 run is this far from its float32 (measured 7.8e-3)
    bfl_extra: dict = {}
    # the released sizes: (name, diffusers config, parameter count, our module's tensors, params.describe())
    REAL = dict(_class_name="Flux2Transformer2DModel", attention_head_dim=128, axes_dims_rope=[32, 32, 32, 32],
                eps=1e-6, guidance_embeds=False, in_channels=128, mlp_ratio=3.0, out_channels=None, patch_size=1,
                rope_theta=2000, timestep_guidance_channels=256)  # fmt: skip
    released = [
        ("klein-4b", dict(REAL, joint_attention_dim=7680, num_attention_heads=24, num_layers=5, num_single_layers=20),
         3_875_544_576, 149, "klein-4B (hidden 3072, 5 double / 20 single blocks)"),
        ("klein-9b", dict(REAL, joint_attention_dim=12288, num_attention_heads=32, num_layers=8, num_single_layers=24),
         9_078_581_248, 201, "klein-9B (hidden 4096, 8 double / 24 single blocks)"),
    ]  # fmt: skip

    def reference(self, variant: str = "tiny", seed: int = 0):
        from diffusers import Flux2Transformer2DModel

        torch.manual_seed(0)
        return randomize_(Flux2Transformer2DModel(**self.CONFIGS[variant]), seed=seed).eval()

    def load(self, reference, folder, dtype=mx.float32):
        """Ours from the reference saved as diffusers saves it (a single file), through the loader."""
        reference.save_pretrained(folder)
        return load_one("transformer", folder, dtype=dtype)

    def inputs(self, reference, B, grid, refs, seed) -> Inputs:
        """Random latents/text and the reference pipeline's own position ids (target, then refs at t=10, 20)."""
        from diffusers import Flux2KleinPipeline

        C, ctx = reference.config.in_channels, reference.config.joint_attention_dim
        g = torch.Generator().manual_seed(seed)
        txt = torch.randn(B, LT, ctx, generator=g)
        txt_ids = Flux2KleinPipeline._prepare_text_ids(txt)  # (B, LT, 4)
        img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(B, C, *grid))
        if refs:
            ref_ids = Flux2KleinPipeline._prepare_image_ids([torch.zeros(1, C, h, w) for h, w in refs])
            img_ids = torch.cat([img_ids, ref_ids.expand(B, -1, -1)], dim=1)
        img = torch.randn(B, img_ids.shape[1], C, generator=g)
        return Inputs(img, txt, img_ids, txt_ids, None, None, grid, refs)

    def our_ids(self, model, x: Inputs):
        """(txt_ids, img_ids) from our own RoPE helpers and the family's reference ids."""
        fam = FAMILIES[self.family]
        ids = [image_ids(*x.grid)] + [fam.reference_ids(k, h, w) for k, (h, w) in enumerate(x.refs)]
        return text_ids(LT), mx.concatenate(ids, axis=0), None

    def rope(self, model, x: Inputs):
        txt_ids, img_ids, _ = self.our_ids(model, x)
        return model.compute_rope(txt_ids, img_ids)

    def theirs(self, reference, x: Inputs, t, target=None):
        with torch.no_grad():
            return reference(x.img, x.txt, torch.tensor(t), x.img_ids, x.txt_ids, return_dict=False)[0]

    def ours(self, model, x: Inputs, t, target=None, ids=None):
        txt_ids, img_ids, _ = ids or (to_mx(x.txt_ids), to_mx(x.img_ids), None)
        return model(to_mx(x.img), to_mx(x.txt), to_mx(torch.tensor(t)), img_ids, txt_ids)

    def with_rope(self, model, x: Inputs, t, target, rope, **kw):
        return model.forward_with_rope(to_mx(x.img), to_mx(x.txt), mx.array(t), rope, **kw)

    def cached_paths(self, model, x: Inputs, t, target, rope) -> dict:
        """What the pipeline computes once per image instead of every step, and its output."""
        img = to_mx(x.img)
        txt = model.embed_text(to_mx(x.txt))
        return {"hoisted text": model.forward_with_rope(img, None, mx.array(t), rope, txt_embedded=txt)}

    def bfl_state(self, reference) -> tuple[dict, dict]:
        """(the reference's weights under BFL's names, what diffusers' own BFL converter maps them back to)."""
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
        from tiny_model import diffusers_to_bfl

        bfl = diffusers_to_bfl(reference.state_dict())
        return bfl, convert_flux2_transformer_checkpoint_to_diffusers({k: v.clone() for k, v in bfl.items()})

    def count(self, params) -> int:
        from flux_klein_mlx.bench.flops import count_parameters

        return count_parameters(params)


class Flux3Transformers:
    """FLUX 3 Image Klein's transformer against diffusers' Flux3Transformer2DModel (Base and flow map)."""

    family = "flux3"
    # flux3.md section 4's tiny configs: "small" (2 heads of 16, text width 24) and "g64", whose every Linear but
    # the 32-wide input projections has an input width that is a multiple of 64 (4-bit group-64 quantization).
    CONFIGS = {
        "small": dict(in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                      num_attention_heads=2, joint_attention_dim=24, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4)),
        "g64": dict(in_channels=32, cond_in_channels=32, num_layers=2, num_single_layers=2, attention_head_dim=32,
                    num_attention_heads=2, joint_attention_dim=128, timestep_channels=256, axes_dims_rope=(8, 8, 8, 8)),
    }  # fmt: skip
    variants = tuple(f"{n}-fm{f}" for n in CONFIGS for f in (0, 1))
    # t2i; batch 2 with different t and one reference; two references of different grids at l = -1, -2 on a
    # non-square target
    cases = [
        (1, (4, 6), [], [0.7], [0.55]),
        (2, (3, 5), [(2, 3)], [0.9, 0.3], [0.8, 0.0]),
        (2, (5, 3), [(2, 3), (4, 2)], [0.05, 0.6], [0.0, 0.45]),
    ]
    # measured 1.3e-6 .. 8.6e-6 (abs 3e-5 on outputs ~4): MLX's float32 exp is 1 ulp off torch's on most of the
    # timestep frequencies, which t x 1000 amplifies; diffusers' own float32 is 3.5e-7 from its float64
    tolerance = 2e-5
    cached_variant, cached_tolerance = "small-fm0", 1e-6  # Base's text and reference modes, once per image
    quantization = [(4, 64, "g64-fm1")]
    quantized_layer, float_layer = "single_blocks.0.mlp_out", "emb_in.image"
    # diffusers' own bf16 run is ~0.2 from its float32 one (mostly bf16(sigma) x 1000 moving the sinusoid): ours
    # must round the sigma as it does
    bf16_variant, bf16_apart = "g64-fm1", 0.05
    bfl_extra = {"repa_projectors.0.weight": torch.ones(3, 4)}  # a training-only REPA head: dropped
    TITLE = "FLUX 3 Image Klein (hidden 3072, 5 mode / 28 single blocks)"
    released = [
        ("base", dict(flow_map=False), 5_538_458_368, None, TITLE),
        ("distilled", dict(flow_map=True), 5_548_681_984, None, TITLE),
    ]

    def reference(self, variant: str = "small-fm0", seed: int = 1):
        """`seed` + 1 for the flow map."""
        from diffusers import Flux3Transformer2DModel

        name, fm = variant.split("-fm")
        flow_map = bool(int(fm))
        torch.manual_seed(0)
        config = dict(self.CONFIGS[name], mlp_ratio=3.0, rope_theta=10000, eps=1e-6, flow_map=flow_map)
        return randomize_(Flux3Transformer2DModel(**config), seed=seed + flow_map).eval()

    def load(self, reference, folder=None, dtype=None):
        """Ours from the reference's state dict: sanitized, params from the shapes, strict load."""
        from flux_klein_mlx.models.flux3.transformer import sanitize_flux3_weights

        weights = sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()})
        return load_weights(self.family, weights, dtype)

    def inputs(self, reference, B, grid, refs, seed) -> Inputs:
        """Random tokens and the modular pipeline's own ids: image (0, y/2, x/2, 0), reference k at l = -(k+1)."""
        from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

        C, ctx = reference.config.in_channels, reference.config.joint_attention_dim
        g = torch.Generator().manual_seed(seed)
        txt = torch.randn(B, LT, ctx, generator=g)
        txt_ids = Flux3TextRoPEInputsStep._prepare_text_ids(txt)  # (LT, 4)
        img_ids = _prepare_image_ids(*grid, 0.5)
        img = torch.randn(B, img_ids.shape[0], C, generator=g)
        if not refs:
            return Inputs(img, txt, img_ids, txt_ids, None, None, grid, refs)
        ref_ids = torch.cat([_prepare_image_ids(h, w, 0.5, l_coord=-(1 + k)) for k, (h, w) in enumerate(refs)])
        ref = torch.randn(B, ref_ids.shape[0], C, generator=g)
        return Inputs(img, txt, img_ids, txt_ids, ref, ref_ids, grid, refs)

    def our_ids(self, model, x: Inputs):
        fam = FAMILIES[self.family]
        refs = [fam.reference_ids(k, h, w) for k, (h, w) in enumerate(x.refs)]
        img = image_ids(*x.grid, scale=model.params.image_rope_scale)
        return text_ids(LT), img, mx.concatenate(refs, axis=0) if refs else None

    def rope(self, model, x: Inputs):
        return model.compute_rope(*self.our_ids(model, x))

    def theirs(self, reference, x: Inputs, t, target=None):
        tt = torch.tensor(target) if target is not None and reference.config.flow_map else None
        with torch.no_grad():
            out = reference(
                x.img, x.txt, torch.tensor(t), x.img_ids, x.txt_ids, x.ref, x.ref_ids, tt, return_dict=False
            )
        return out[0]

    def ours(self, model, x: Inputs, t, target=None, ids=None):
        txt_ids, img_ids, ref_ids = ids or (to_mx(x.txt_ids), to_mx(x.img_ids), _mx(x.ref_ids))
        tt = mx.array(target) if target is not None and model.params.flow_map else None
        return model(to_mx(x.img), to_mx(x.txt), to_mx(torch.tensor(t)), img_ids, txt_ids, _mx(x.ref), ref_ids, tt)

    def with_rope(self, model, x: Inputs, t, target, rope, **kw):
        tt = mx.array(target) if target is not None and model.params.flow_map else None
        img, txt, ref = to_mx(x.img), to_mx(x.txt), _mx(x.ref)
        return model.forward_with_rope(img, txt, mx.array(t), rope, ref=ref, target_timesteps=tt, **kw)

    def cached_paths(self, model, x: Inputs, t, target, rope) -> dict:
        """Base: the text and reference mode stacks (t = 0) computed once per image, and its output."""
        txt_early, ref_early = model.early_text(to_mx(x.txt), rope), model.early_references(_mx(x.ref), rope)
        out = model.forward_with_rope(to_mx(x.img), None, mx.array(t), rope, txt_early=txt_early, ref_early=ref_early)
        return {"early text and references": out}

    def bfl_state(self, reference) -> tuple[dict, dict]:
        """The reference's weights under BFL's names (as our sanitizer names them), and what diffusers' own BFL
        converter maps them back to."""
        from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers

        from flux_klein_mlx.models.flux3.transformer import sanitize_flux3_weights

        ours = sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()})
        bfl = {k: torch.from_numpy(np.array(v)) for k, v in ours.items()} | self.bfl_extra
        return bfl, convert_flux3_transformer_checkpoint_to_diffusers(dict(bfl))

    def count(self, params) -> int:
        """The Linears' weights and the QK-norm scales (two a block: 3 streams in a mode block, 1 in a single)."""
        from flux_klein_mlx.models.flux3.transformer import linear_shapes

        norms = (3 * params.depth + params.depth_single) * 2 * params.head_dim
        return sum(o * i for o, i in linear_shapes(params).values()) + norms


TRANSFORMERS = {"flux2": Flux2Transformers(), "flux3": Flux3Transformers()}
