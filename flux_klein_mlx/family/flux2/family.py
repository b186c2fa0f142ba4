"""FLUX.2 [klein] 4B / 9B (distilled, Base, 9B-KV): the first family.

Text is Qwen3 tapped after layers 9, 18, 27, padded to a fixed 512 tokens; the schedule is BFL's
resolution-dependent shift (`sampling.schedule`); references join the target tokens in one image
stream at RoPE time 10 (k + 1); CFG runs cond and uncond as one batch of 2 (both windows are 512).
"""

from __future__ import annotations

import time

import mlx.core as mx

from ...events import Job
from ...inputs.images import MAX_ASPECT, preprocess_reference
from ...limits import MIN_SIDE
from ...models.flux2.config import (
    HIDDEN_SIZES,
    KV_PIPELINE_CLASS,
    PIPELINE_CLASSES,
    VARIANTS,
    FluxKleinParams,
    sampling_defaults,
    variant_for,
)
from ...models.flux2.transformer import FluxKlein, infer_params, linear_shapes, sanitize_flux2_klein_weights
from ...models.kv_cache import ReferenceKV
from ...models.rope import image_ids, text_ids
from ...models.text_encoder import OUT_LAYERS, encode_prompts
from ...models.tokenizer import FLUX2_WINDOW, MAX_LENGTH
from ...sampling import cfg, model_timestep, reference_time, schedule
from ..base import LoraNames
from .lora import DIFFUSERS_FUSED, FLUX2_MARKERS, flux2_modules, flux2_table, guess_params


class Flux2Steps:
    """One image's FLUX.2 calls. Joint sequence [text ; target ; references]; with CFG a batch of 2.

    The KV variant with references takes them out of the sequence: their keys/values come from a
    cache filled at the first step (`FluxKlein.reference_kv`) and dropped with this object.
    """

    def __init__(self, model: FluxKlein, job: Job, *, dtype: mx.Dtype, reference_kv: bool, low_memory: bool):
        h, w = job.grid
        self.model, self.job, self.dtype, self.low_memory = model, job, dtype, low_memory
        self.tokens = h * w
        self.ctx = mx.concatenate(job.ctx, axis=0)  # (1 or 2, 512, C): [cond, uncond] with CFG
        self.batch = self.ctx.shape[0]
        self.use_kv = reference_kv and job.ref_tokens is not None
        self.plain_refs = job.ref_ids is not None and not self.use_kv
        img_ids = mx.concatenate([image_ids(h, w), job.ref_ids], axis=0) if self.plain_refs else image_ids(h, w)
        self.rope = model.compute_rope(text_ids(self.ctx.shape[1]), img_ids)  # built once per shape
        self.txt = model.embed_text(self.ctx)  # step-invariant text projection, hoisted out of the loop
        refs = job.ref_tokens
        self.ref = None if refs is None else mx.broadcast_to(refs, (self.batch,) + refs.shape[1:])
        self.kv_cache: ReferenceKV | None = None

    def velocity(self, x: mx.array, i: int) -> mx.array:
        x_in = mx.broadcast_to(x, (self.batch,) + x.shape[1:])
        if self.use_kv and self.kv_cache is None:
            t0 = time.perf_counter()
            self.kv_cache = self.model.reference_kv(self.ref, self.job.ref_ids, low_memory=self.low_memory)
            mx.eval(self.kv_cache.arrays())  # the extract step, timed on its own
            self.job.stats.reference_kv_seconds = time.perf_counter() - t0
            self.job.stats.reference_kv_bytes = self.kv_cache.nbytes
        elif self.plain_refs:
            x_in = mx.concatenate([x_in, self.ref], axis=1)  # [target; refs]
        t = model_timestep(self.job.sigmas[i], self.batch, self.dtype)
        v = self.model.forward_with_rope(
            x_in, self.ctx, t, self.rope, txt_embedded=self.txt, low_memory=self.low_memory, reference_kv=self.kv_cache
        )[:, : self.tokens]  # target tokens only
        scale = self.job.inputs.cfg_scale
        return cfg(v, scale) if scale is not None else v


class Flux2Family:
    key = "flux2"
    title = "FLUX.2 [klein]"
    upsampler = None
    lora = LoraNames(
        title=title,
        params_type=FluxKleinParams,
        table=flux2_table,
        modules=flux2_modules,
        shapes=linear_shapes,
        markers=FLUX2_MARKERS,
        hidden_sizes=HIDDEN_SIZES,
        guess=guess_params,
        fused=DIFFUSERS_FUSED,
    )
    class_prefix = "Flux2"
    params_type = FluxKleinParams
    text_taps = OUT_LAYERS
    text_window = FLUX2_WINDOW
    text_key = {}  # what the prompt cache's key adds: nothing, so the keys written before families stay valid
    index_files = ("model_index.json",)
    pipeline_classes = PIPELINE_CLASSES
    variants = VARIANTS
    trains_distilled = True  # warned: it breaks the distillation, but the networks are the same
    train_shift = None  # musubi's flux2_shift: by the image's token count (train/step/objective.py)
    target_groups = {"double": ("transformer_blocks", "depth"), "single": ("single_transformer_blocks", "depth_single")}
    reference_group = None  # references share the target's blocks
    planned_text_tokens = MAX_LENGTH

    def is_distilled(self, index: dict, transformer_config: dict) -> bool:
        """The index says (klein 9B-KV's has no is_distilled key: its pipeline class tells it)."""
        return bool(index.get("is_distilled", False)) or index.get("_class_name") == KV_PIPELINE_CLASS

    def reference_kv(self, index: dict) -> bool:
        return index.get("_class_name") == KV_PIPELINE_CLASS

    def encode_prompts(self, encoder, tokenizer, prompts: list[str]) -> list[mx.array]:
        """One (1, 512, C) embedding per prompt, all from one batched call (every window is 512)."""
        emb = encode_prompts(encoder, tokenizer, prompts, FLUX2_WINDOW)
        return [emb[i : i + 1] for i in range(len(prompts))]

    def model_title(self, params: FluxKleinParams, distilled: bool, reference_kv: bool) -> str:
        row = variant_for(params, distilled, reference_kv)
        custom = f"{self.title} (custom size)" + (" KV" if reference_kv else "" if distilled else " Base")
        return row.title if row is not None else custom

    def prepare_references(self, images: list, model_name: str) -> tuple[list, tuple | None]:
        # The spec's limits (8.1): a side of 64 px at least, 8:1 at most; no crop back.
        return [preprocess_reference(im, min_side=MIN_SIDE, max_aspect=MAX_ASPECT) for im in images], None

    # The contract's pieces that are its networks' and schedule's own functions (family/base.py types them).
    params = staticmethod(FluxKleinParams.from_dict)
    build_transformer = staticmethod(FluxKlein)
    sanitize_transformer = staticmethod(sanitize_flux2_klein_weights)
    infer_params = staticmethod(infer_params)
    linear_shapes = staticmethod(linear_shapes)
    defaults = staticmethod(sampling_defaults)
    sigmas = staticmethod(schedule)  # step-fitted: by the image's tokens
    size_key = staticmethod(FluxKleinParams.shape_key)

    def reference_ids(self, k: int, h: int, w: int) -> mx.array:
        return image_ids(h, w, t=reference_time(k))

    def distilled_repo(self, model: str) -> str | None:
        name = model.lower()
        return next(
            (VARIANTS[v.family].repo for v in VARIANTS.values() if not v.distilled and v.repo.lower() == name), None
        )

    def training_rope(self, model, grid: tuple[int, int], references: int, text_tokens: int):
        """One image stream: [target ; reference 0 ; ...], each reference at RoPE time 10 (k + 1)."""
        ids = [image_ids(*grid)] + [self.reference_ids(k, *grid) for k in range(references)]
        return model.compute_rope(text_ids(text_tokens), mx.concatenate(ids, axis=0))

    def training_velocity(self, model, xt, ctx, *, sigma, rope, refs, checkpoint: bool) -> mx.array:
        """The references follow the target tokens in its stream; the transformer sees sigma rounded to the
        activation dtype (diffusers' `timesteps / 1000` of the scheduler's float32 timesteps)."""
        dtype = model.dtype
        x_in = xt.astype(dtype) if refs is None else mx.concatenate([xt.astype(dtype), refs.astype(dtype)], axis=1)
        return model.forward_with_rope(x_in, ctx, sigma.astype(dtype), rope, checkpoint=checkpoint)[:, : xt.shape[1]]

    def steps(self, model, job: Job, *, dtype: mx.Dtype, reference_kv: bool, low_memory: bool) -> Flux2Steps:
        return Flux2Steps(model, job, dtype=dtype, reference_kv=reference_kv, low_memory=low_memory)


FLUX2 = Flux2Family()
