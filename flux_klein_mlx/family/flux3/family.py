"""FLUX 3 Image Klein (distilled flow map, Base): the second family.

What differs from FLUX.2 [klein] (docs/flux3.md):
- text: Qwen3-VL's language tower tapped after layers 4, 8, ..., 32, each prompt right-padded to the next
  multiple of 80 tokens (pads at position 1): a cond and an uncond prompt have windows of their own, so
  Base's CFG runs two passes, never a batch of 2;
- the schedule: a constant shift of 6.93 over linspace(1, 1/N, N); the transformer casts the sigma to
  its dtype and multiplies by 1000 there (`sampling.flow_timestep` is what it is handed);
- references: their own token mode (own input layer, own mode blocks, t = 0), RoPE ids on the l axis
  (-1, -2, ...) with h, w scaled by 0.5 like the image's; one reference is kept whole on a padded
  canvas and the output cropped back to it (`references.prepare_canvas_reference`); at most 10;
- the distilled model is a flow map: each step also sees the sigma it jumps to (the next one, 0 after
  the last step), which changes the text and reference modes every step. On Base they see t = 0 at every
  step, so their mode blocks run once per image (`Flux3.early_text`, `early_references`).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from ...events import Job
from ...models.flux3.config import FLUX3_PIPELINE_CLASSES, FLUX3_VARIANTS, Flux3Params
from ...models.flux3.transformer import Flux3, infer_flux3_params, linear_shapes, sanitize_flux3_weights
from ...models.rope import image_ids, text_ids
from ...models.text_encoder import FLUX3_TAPS, encode_prompts
from ...models.tokenizer import FLUX3_WINDOW
from ...sampling import cfg, flow_timestep, shifted_schedule
from ..base import LoraNames
from .lora import FLUX3_MARKERS, flux3_check, flux3_modules, flux3_table, guess_params
from .references import prepare_flux3_references

SHIFT = 6.93  # diffusers' Flux3SetTimestepsStep and mflux: sigma' = 6.93 sigma / (1 + 5.93 sigma)
# what the memory plan counts for a caption before it is encoded: two windows of 80 (about 100 words)
PLANNED_TEXT_TOKENS = 160


class Flux3Steps:
    """One image's FLUX 3 calls: the RoPE tables of each prompt's window, Base's once-per-image text and
    reference modes, then per step one pass per prompt (cond, and uncond with CFG)."""

    def __init__(self, model: Flux3, job: Job, *, low_memory: bool):
        h, w = job.grid
        params = model.params
        self.model, self.job, self.low_memory = model, job, low_memory
        self.flow_map = params.flow_map
        img_ids = image_ids(h, w, scale=params.image_rope_scale)
        self.ropes = [model.compute_rope(text_ids(c.shape[1]), img_ids, job.ref_ids) for c in job.ctx]
        self.ref = job.ref_tokens  # (1, Lr, C) or None
        self.txt_early = self.ref_early = None
        if not self.flow_map:  # Base: text and references sit at t = 0 at every step
            self.txt_early = [model.early_text(c, r) for c, r in zip(job.ctx, self.ropes, strict=True)]
            if self.ref is not None:  # one reference stream shared by the cond and uncond passes
                self.ref_early = model.early_references(self.ref, self.ropes[0])
            mx.eval(self.txt_early, self.ref_early)

    def velocity(self, x: mx.array, i: int) -> mx.array:
        sigmas = self.job.sigmas
        t = flow_timestep(sigmas[i], x.shape[0])
        target = flow_timestep(sigmas[i + 1], x.shape[0]) if self.flow_map else None
        passes = []
        for n, (ctx, rope) in enumerate(zip(self.job.ctx, self.ropes, strict=True)):
            early = self.txt_early[n] if self.txt_early is not None else None
            passes.append(
                self.model.forward_with_rope(
                    x,
                    None if early is not None else ctx,
                    t,
                    rope,
                    ref=None if self.ref_early is not None else self.ref,
                    target_timesteps=target,
                    txt_early=early,
                    ref_early=self.ref_early,
                    low_memory=self.low_memory,
                )
            )
        scale = self.job.inputs.cfg_scale
        return cfg(mx.concatenate(passes, axis=0), scale) if scale is not None else passes[0]


class Flux3Family:
    key = "flux3"
    title = "FLUX 3 Image Klein"
    upsampler = "black-forest-labs/flux-3-image-klein-pup"
    lora = LoraNames(
        title=title,
        params_type=Flux3Params,
        table=flux3_table,
        modules=flux3_modules,
        shapes=linear_shapes,
        markers=FLUX3_MARKERS,
        hidden_sizes={Flux3Params().hidden_size: title},
        guess=guess_params,
        check=flux3_check,
    )
    class_prefix = "Flux3"
    params_type = Flux3Params
    text_taps = FLUX3_TAPS
    text_window = FLUX3_WINDOW
    # what the prompt cache's key adds: the taps and the window rule decide the embeddings too
    text_key = {
        "taps": list(FLUX3_TAPS),
        "window": [FLUX3_WINDOW.multiple, FLUX3_WINDOW.max_length, FLUX3_WINDOW.pad_position],
    }
    index_files = ("modular_model_index.json", "model_index.json")
    pipeline_classes = FLUX3_PIPELINE_CLASSES
    variants = FLUX3_VARIANTS  # the released models' rows (steps 16 / 50, Base guidance 3.5)
    trains_distilled = False  # a flow map: its steps need a target time the objective has no value for
    train_shift = SHIFT  # the sampling schedule's constant shift (docs/training.md#flux-3-image-klein)
    target_groups = {
        "image": ("mode_blocks.image", "depth"),
        "reference": ("mode_blocks.image_cond", "depth"),
        "text": ("txt_mode_blocks", "depth"),
        "single": ("single_transformer_blocks", "depth_single"),
    }
    reference_group = "reference"
    planned_text_tokens = PLANNED_TEXT_TOKENS

    def is_distilled(self, index: dict, transformer_config: dict) -> bool:
        """The transformer says: the distilled model is a flow map (its config's flow_map, BFL's ref_time_in)."""
        return bool(self.params(transformer_config).flow_map)

    def reference_kv(self, index: dict) -> bool:
        return False  # no KV-distilled FLUX 3 model is released

    def encode_prompts(self, encoder, tokenizer, prompts: list[str]) -> list[mx.array]:
        """One (1, L, C) embedding per prompt, each in its own window (L: its length rounded up to 80)."""
        return [encode_prompts(encoder, tokenizer, [p], FLUX3_WINDOW) for p in prompts]

    def model_title(self, params: Flux3Params, distilled: bool, reference_kv: bool) -> str:
        return self.title + ("" if distilled else " Base")

    # The contract's pieces that are its networks' and references' own functions (family/base.py types them).
    prepare_references = staticmethod(prepare_flux3_references)
    params = staticmethod(Flux3Params.from_dict)
    build_transformer = staticmethod(Flux3)
    sanitize_transformer = staticmethod(sanitize_flux3_weights)
    infer_params = staticmethod(infer_flux3_params)
    linear_shapes = staticmethod(linear_shapes)

    def defaults(self, distilled: bool) -> tuple[int, float | None]:
        row = self.variants["flux3-klein" if distilled else "flux3-klein-base"]
        return row.steps, row.guidance

    def sigmas(self, image_tokens: int, steps: int) -> list[float]:
        return shifted_schedule(steps, SHIFT)  # the same at every resolution

    def reference_ids(self, k: int, h: int, w: int) -> mx.array:
        return image_ids(h, w, scale=Flux3Params.image_rope_scale, l=-(k + 1))

    def distilled_repo(self, model: str) -> str | None:
        """The distilled model's repo id for the Base's (its samples run there), from the released rows."""
        repos = {row.distilled: row.repo for row in self.variants.values()}
        return repos[True] if model.lower() == repos[False].lower() else None

    def size_key(self, params: Flux3Params) -> tuple:
        """The shapes less the flow map's embedder: a Base LoRA of the blocks runs on the distilled model."""
        return replace(params, flow_map=False).shape_key()

    def training_rope(self, model, grid: tuple[int, int], references: int, text_tokens: int):
        """Text, target and references each in their own mode; reference k at l = -(k + 1)."""
        img = image_ids(*grid, scale=model.params.image_rope_scale)
        refs = [self.reference_ids(k, *grid) for k in range(references)]
        return model.compute_rope(text_ids(text_tokens), img, mx.concatenate(refs, axis=0) if refs else None)

    def training_velocity(self, model, xt, ctx, *, sigma, rope, refs, checkpoint: bool) -> mx.array:
        """The references as their own stream; the image at sigma (float32: the model casts it to its dtype and
        scales it by 1000 there, as diffusers' `timestep`), text and references at 0 (the model's rule)."""
        dtype = model.dtype
        ref = None if refs is None else refs.astype(dtype)
        return model.forward_with_rope(xt.astype(dtype), ctx, sigma, rope, ref=ref, checkpoint=checkpoint)

    def steps(self, model, job: Job, *, dtype: mx.Dtype, reference_kv: bool, low_memory: bool) -> Flux3Steps:
        return Flux3Steps(model, job, low_memory=low_memory)


FLUX3 = Flux3Family()
