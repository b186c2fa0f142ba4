"""The FLUX.2 [klein] pipeline: prompt -> embeddings -> 4 (or 50) flow steps -> VAE decode.

Staged for memory (style.md habit 5): the text encoder is loaded to encode a prompt and released
right after (embeddings of recent prompts are kept, so repeated prompts never reload it); with
`low_memory` the transformer is also released before the VAE decode. Each stage's wall time and
peak memory are recorded in `Progress.stats`. `stream()` is a generator that yields after every
denoising step, so a caller can draw progress or stop by breaking out of the loop; `generate()`
runs it to the end.
"""

from __future__ import annotations

import math
import numbers
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np
from PIL import Image

from .errors import FluxKleinError
from .img2img import MAX_AREA, blend, check_image_shape, open_image, prepare_init_image, scale_noise, start_step
from .loading import ModelInfo, as_dtype, check_weights, describe, load_component, read_component
from .lora import apply_loras, load_loras
from .noise import check_noise_kind, initial_noise
from .quantize import check_quantization
from .rope import image_ids, text_ids
from .sampler import FluxSampler
from .text_encoder import encode_prompts
from .tokenizer import check_text, load_tokenizer
from .vae import check_image_size



@dataclass
class Progress:
    """One event of `FluxKleinPipeline.stream`: a finished stage or denoising step."""

    stage: str  # "encode" | "denoise" | "decode"
    step: int = 0  # denoising step just finished (1-based); 0 outside the loop
    total: int = 0  # number of denoising steps
    seconds: float = 0.0  # wall time of this step or stage
    image: Image.Image | np.ndarray | None = None  # set on the final "decode" event
    stats: dict = field(default_factory=dict)  # per stage: {"seconds": s, "peak_memory": bytes}
    # "denoise" events: the step's estimate of the clean latent tokens (1, h*w, C), lazy (for previews)
    denoised: mx.array | None = None
    grid: tuple[int, int] = (0, 0)  # (h, w) of the latent token grid: image size / 16


@dataclass
class Job:
    """One image in flight between the stages: conditioning, the latents and the run's stats."""

    x: mx.array  # (1, h*w, 128) packed latents; the denoise stage advances it
    ctx: mx.array  # (1 or 2, 512, 3*hidden) prompt embeddings; [cond, uncond] with CFG
    ref_tokens: mx.array | None  # (1, sum h_k*w_k, 128) reference tokens, or None
    ref_ids: mx.array | None  # (sum h_k*w_k, 4) their RoPE ids
    h: int  # latent grid (pixels / 16)
    w: int
    steps: int
    guidance: float | None  # CFG scale when CFG runs, else None
    stats: dict
    # Image-to-image / inpainting (img2img.py); defaults mean text-to-image.
    t_start: int = 0  # schedule steps skipped (strength); the schedule is still built for `steps`
    x0: mx.array | None = None  # (1, h*w, 128) init image tokens
    prior: mx.array | None = None  # (1, h*w, 128) float32 noise, reused to re-noise the kept region
    mask: mx.array | None = None  # (1, h*w, 1) inpainting mask on the token grid, 1 = repaint

    @property
    def steps_run(self) -> int:
        return self.steps - self.t_start


class _Slot:
    """A model that is loaded on first use and can be released to free its memory."""

    def __init__(self, loader: Callable[[], object]):
        self._loader = loader
        self._model = None

    def get(self):
        if self._model is None:
            self._model = self._loader()
        return self._model

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def release(self) -> None:
        self._model = None
        mx.clear_cache()


def _to_pil_rgb(image) -> Image.Image:
    return open_image(image, "reference image").convert("RGB")


def preprocess_reference(image, multiple: int = 16) -> np.ndarray:
    """A reference image as the references prepare it: (H, W, 3) float32 in [-1, 1].

    Validate (each side >= 64 px, aspect ratio <= 8), shrink to 1024^2 px area with Lanczos if
    larger (sizes truncated), floor both sides to multiples of 16 and centre-crop (spec 8.1).
    """
    img = _to_pil_rgb(image)
    w, h = img.size
    check_image_shape(w, h, "reference image")
    if w * h > MAX_AREA:
        scale = math.sqrt(MAX_AREA / (w * h))
        img = img.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)
        w, h = img.size
    cw, ch = (w // multiple) * multiple, (h // multiple) * multiple
    left, top = (w - cw) // 2, (h - ch) // 2
    img = img.crop((left, top, left + cw, top + ch))
    return np.asarray(img, dtype=np.float32) / 127.5 - 1.0


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_settings(prompt, negative_prompt=None, width=None, height=None, steps=None, guidance=None, seed=None):
    """Types and ranges of a run's settings, checked before any model runs (one-line errors).

    Seeds are any whole number: torch noise uses `seed mod 2**32` (as torch does, negative seeds
    wrap), MLX noise `seed mod 2**64`. Guidance must be a finite number >= 0 (at most 1 runs no CFG,
    as in diffusers).
    """
    if not isinstance(prompt, str):
        raise FluxKleinError(f"the prompt must be a string, not {type(prompt).__name__}")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise FluxKleinError(f"negative_prompt must be a string or None, not {type(negative_prompt).__name__}")
    check_text(prompt)
    if negative_prompt is not None:
        check_text(negative_prompt, "the negative prompt")
    for name, v in (("width", width), ("height", height)):
        if v is not None and not _is_int(v):
            raise FluxKleinError(f"{name} must be a whole number of pixels, not {v!r}")
    if steps is not None and (not _is_int(steps) or steps < 1):
        raise FluxKleinError(f"steps must be a whole number of at least 1, not {steps!r}")
    if guidance is not None and (
        isinstance(guidance, bool) or not isinstance(guidance, numbers.Real) or not math.isfinite(guidance)
        or guidance < 0
    ):  # fmt: skip
        raise FluxKleinError(f"guidance must be a finite number >= 0 (e.g. 4.0; at most 1 turns CFG off), not {guidance!r}")
    if seed is not None and not _is_int(seed):
        raise FluxKleinError(f"seed must be a whole number, not {seed!r}")


def pack_latents(latents: mx.array) -> mx.array:
    """Noise in diffusers' layout (B, C, h, w) -> tokens (B, h*w, C), row-major (C = 128 for klein)."""
    B, C, h, w = latents.shape
    return latents.reshape(B, C, h * w).transpose(0, 2, 1)


def to_output(images: mx.array, output_type: str):
    """Decoded images (1, H, W, 3), nominally [-1, 1] -> PIL (rounded) or float32 [0, 1] array."""
    x = np.array(mx.clip(images[0].astype(mx.float32) / 2 + 0.5, 0.0, 1.0))
    if output_type == "np":
        return x
    return Image.fromarray(np.round(x * 255).astype(np.uint8))


class FluxKleinPipeline:
    """Text-to-image, editing and multi-reference generation with a loaded klein model.

    Build it with `flux_klein_mlx.load(...)`. Components are held in slots so that the pipeline
    can release and reload them between stages.
    """

    def __init__(
        self,
        transformer: Callable[[], object],
        text_encoder: Callable[[], object],
        tokenizer: Callable[[], object],
        vae: Callable[[], object],
        info: ModelInfo,
        *,
        dtype=mx.bfloat16,
        low_memory: bool = False,
        quantization: dict | None = None,
        loras: list | None = None,
    ):
        self.loras = list(loras or [])  # lora.Lora, applied whenever the transformer (re)loads
        self.transformer = _Slot(self._with_loras(transformer))
        self.text_encoder = _Slot(text_encoder)
        self.tokenizer = _Slot(tokenizer)
        self.vae = _Slot(vae)
        self.info = info
        self.dtype = dtype
        self.quantization = quantization  # {"bits", "group_size", ...} or None
        self.low_memory = low_memory
        self._prompt_cache: dict[str, mx.array] = {}  # prompt -> (1, 512, C) embeddings

    # ---- LoRAs ---------------------------------------------------------------------------------

    def _with_loras(self, loader: Callable[[], object]) -> Callable[[], object]:
        def load_and_apply():
            model = loader()
            if self.loras:
                # Low-memory mode reloads the transformer for every image anyway: no copy of the original
                # weights is kept, a change of LoRAs releases the model. Otherwise the originals of fused
                # layers are kept as lazy arrays of the model's files: a LoRA costs its own size either way.
                apply_loras(model, self.loras, keep_originals=not self.low_memory, reread=self._reread())
            return model

        return load_and_apply

    def _reread(self) -> Callable[[str], mx.array] | None:
        """Original float weights of transformer layers, lazily from the files (None: no files)."""
        if self.info.format not in ("diffusers", "mlx"):
            return None
        weights = read_component(self.info, "transformer")  # lazy: nothing is read until evaluated
        return lambda path: weights[f"{path}.weight"].astype(self.dtype)

    def set_loras(self, loras, partial: bool = False) -> None:
        """Replace the applied LoRAs, e.g. `["a.safetensors", ("b.safetensors", 0.8)]`; `[]` removes them.

        The base model is not reloaded: fused LoRAs are unfused exactly, side paths dropped (in
        low-memory mode the transformer, reloaded for every image anyway, is released instead). Every
        file is read and checked first; on any error the pipeline keeps its previous LoRAs.
        """
        parsed = load_loras(loras, self.info.params, partial)
        if self.transformer.loaded and self.low_memory:
            self.transformer.release()
        elif self.transformer.loaded:
            apply_loras(self.transformer.get(), parsed)
        self.loras = parsed

    # ---- stages -------------------------------------------------------------------------------

    def encode_prompts(self, prompts: Sequence[str]) -> mx.array:
        """Embeddings (B, 512, 3*hidden) for `prompts`; the text encoder is released afterwards."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._prompt_cache]
        if missing:
            emb = encode_prompts(self.text_encoder.get(), self.tokenizer.get(), missing).astype(self.dtype)
            mx.eval(emb)
            self._check_finite(emb, "the text encoder's prompt embeddings")
            for i, p in enumerate(missing):
                self._prompt_cache[p] = emb[i : i + 1]
            # Keep a handful of recent prompts; the encoder itself is the big allocation.
            while len(self._prompt_cache) > 8:
                self._prompt_cache.pop(next(iter(self._prompt_cache)))
            self.text_encoder.release()
        return mx.concatenate([self._prompt_cache[p] for p in prompts], axis=0)

    def remember_prompt(self, prompt: str, embeddings: mx.array) -> None:
        """Use `embeddings` (1, 512, C) for `prompt` from now on instead of running the text encoder."""
        self._prompt_cache[prompt] = embeddings.astype(self.dtype)

    def encode_references(self, images: Sequence, first_t: int = 10) -> tuple[mx.array, mx.array, tuple[int, int]]:
        """VAE-encode references -> tokens (1, sum h_k*w_k, 128), ids (.., 4), first one's (W, H).

        Reference k gets time coordinate first_t + 10 k (an init image takes 10, references follow).
        """
        vae = self.vae.get()
        tokens, ids, first_size = [], [], None
        for k, image in enumerate(images):
            pixels = preprocess_reference(image)  # (H, W, 3)
            H, W = pixels.shape[:2]
            first_size = first_size or (W, H)
            tok = vae.encode_to_tokens(mx.array(pixels)[None].astype(self.dtype))  # (1, H/16*W/16, 128)
            tokens.append(tok)
            ids.append(image_ids(H // 16, W // 16, t=first_t + 10 * k))
        out = mx.concatenate(tokens, axis=1), mx.concatenate(ids, axis=0)
        mx.eval(out)
        self._check_finite(out[0], "the VAE encoding of the reference image(s)")
        return out[0], out[1], first_size

    def _nan_hint(self) -> str:
        if self.dtype == mx.float32:
            return "the weights are probably damaged (the run is already float32); download or convert them again"
        return "the weights may be damaged, or the values overflow this dtype: try --dtype float32 (dtype='float32')"

    def _check_finite(self, x: mx.array, stage: str) -> None:
        """End the run, naming the stage, when `x` holds NaN or infinity."""
        if not mx.all(mx.isfinite(x)).item():
            raise FluxKleinError(f"non-finite values in {stage}: {self._nan_hint()}")

    # ---- the run ------------------------------------------------------------------------------

    def stream(
        self,
        prompt: str,
        *,
        width: int | None = None,
        height: int | None = None,
        steps: int | None = None,
        guidance: float | None = None,
        seed: int | None = None,
        images: Sequence | None = None,
        negative_prompt: str | None = None,
        latents=None,
        output_type: str = "pil",
        noise: str = "torch",
        init_image=None,
        strength: float | None = None,
        mask=None,
    ) -> Iterator[Progress]:
        """Run a generation, yielding a `Progress` after encoding, after every step and at the end.

        The final event (stage "decode") carries the image. See `generate` for the arguments.
        The three stages (`prepare`, `denoise`, `decode`) are public so that the benchmark times
        exactly this code.
        """
        if output_type not in ("pil", "np"):
            raise FluxKleinError(f"output_type must be 'pil' or 'np', not {output_type!r}")
        job = self.prepare(
            prompt, width=width, height=height, steps=steps, guidance=guidance, seed=seed, images=images,
            negative_prompt=negative_prompt, latents=latents, noise=noise, init_image=init_image, strength=strength,
            mask=mask,
        )
        yield Progress("encode", 0, job.steps_run, job.stats["encode"]["seconds"], stats=job.stats)
        yield from self.denoise(job)
        image = self.decode(job, output_type)
        n = job.steps_run
        yield Progress("decode", n, n, job.stats["decode"]["seconds"], image=image, stats=job.stats)

    def prepare(
        self,
        prompt: str,
        *,
        width: int | None = None,
        height: int | None = None,
        steps: int | None = None,
        guidance: float | None = None,
        seed: int | None = None,
        images: Sequence | None = None,
        negative_prompt: str | None = None,
        latents=None,
        noise: str = "torch",
        init_image=None,
        strength: float | None = None,
        mask=None,
    ) -> Job:
        """Stage 1: resolve the settings, encode the prompt(s) and references, draw the noise."""
        info = self.info
        check_settings(prompt, negative_prompt, width, height, steps, guidance, seed)
        steps = info.default_steps if steps is None else int(steps)
        if info.is_distilled:
            if guidance is not None and guidance != 1.0:
                warnings.warn(
                    f"guidance {guidance} is ignored: {info.name} is guidance-distilled (use a Base model for CFG)"
                )
            guidance = None
            if negative_prompt:
                warnings.warn(f"negative_prompt is ignored: {info.name} runs without classifier-free guidance")
        else:
            guidance = info.default_guidance if guidance is None else float(guidance)
        check_noise_kind(noise)
        if init_image is None and (mask is not None or strength is not None):
            what = "a mask" if mask is not None else "strength"
            raise FluxKleinError(f"{what} needs an init image (init_image=, --init-image)")
        # Image-to-image / inpainting (img2img.py): preprocessed before any model runs; sets the size.
        init = None
        if init_image is not None:
            init = prepare_init_image(init_image, 0.8 if strength is None else strength, mask)
            if (width or init.width, height or init.height) != (init.width, init.height):
                raise FluxKleinError(
                    f"the output takes the init image's size ({init.width}x{init.height}); leave width/height unset"
                )
            width, height = init.width, init.height
        t_start = 0 if init is None else start_step(steps, init.strength)
        if isinstance(images, (str, Path, Image.Image)):
            images = [images]
        images = list(images or [])
        if not images:
            width, height = 1024 if width is None else width, 1024 if height is None else height
        # With references, a side left out is the first reference's (checked once it is known).
        check_image_size(1024 if width is None else width, 1024 if height is None else height)
        seed = random.randrange(2**31) if seed is None and latents is None else seed
        stats: dict = {"seed": seed, "steps": steps, "guidance": guidance,
                       "noise": "latents" if latents is not None else noise}
        if init is not None:
            stats.update(strength=init.strength, steps_run=steps - t_start, inpainting=init.mask is not None)

        # Conditioning: prompt embeddings (text encoder released after), reference tokens.
        cfg = guidance is not None and guidance > 1.0
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        prompts = [prompt] + ([negative_prompt or ""] if cfg else [])
        ctx = self.encode_prompts(prompts)  # (1 or 2, 512, C); [cond, uncond]
        ref_tokens = ref_ids = None
        if images:
            ref_tokens, ref_ids, (rw, rh) = self.encode_references(images, first_t=10 if init is None else 20)
            width, height = rw if width is None else width, rh if height is None else height
            check_image_size(width, height)
        x0 = None
        if init is not None:
            # The init image's tokens (1, h*w, 128) are x0 and also the first reference (t = 10).
            x0 = self.vae.get().encode_to_tokens(mx.array(init.pixels)[None].astype(self.dtype))
            x0_ids = image_ids(height // 16, width // 16, t=10)
            ref_tokens = x0 if ref_tokens is None else mx.concatenate([x0, ref_tokens], axis=1)
            ref_ids = x0_ids if ref_ids is None else mx.concatenate([x0_ids, ref_ids], axis=0)
            mx.eval(ref_tokens, ref_ids)
            self._check_finite(x0, "the VAE encoding of the init image")
        stats["encode"] = {"seconds": time.perf_counter() - t0, "peak_memory": mx.get_peak_memory()}
        stats["width"], stats["height"] = width, height

        # Noise in the normalised, patchified latent space.
        h, w, c = height // 16, width // 16, self.info.in_channels
        if latents is not None:
            x = mx.array(np.asarray(latents, dtype=np.float32))
            if x.shape != (1, c, h, w):
                raise FluxKleinError(f"latents must have shape (1, {c}, {h}, {w}) for {width}x{height}, not {x.shape}")
        else:
            x = initial_noise((1, c, h, w), seed, noise)  # float32; torch's CPU randn by default
        prior = pack_latents(x)  # (1, h*w, c) float32
        if init is not None:
            # Noised to the first sigma that runs; mu comes from all `steps` (diffusers' get_timesteps).
            x = scale_noise(x0, prior, FluxSampler().timesteps(h * w, steps)[t_start])
        else:
            x = prior
        mask = None if init is None or init.mask is None else mx.array(init.mask)[None]  # (1, h*w, 1)
        return Job(x=x.astype(self.dtype), ctx=ctx, ref_tokens=ref_tokens, ref_ids=ref_ids, h=h, w=w, steps=steps,
                   guidance=guidance if cfg else None, stats=stats, t_start=t_start, x0=x0, prior=prior, mask=mask)

    def denoise(self, job: Job) -> Iterator[Progress]:
        """Stage 2: the flow steps, a generator that yields after every step; `job.x` advances."""
        mx.reset_peak_memory()
        t_stage = time.perf_counter()
        model = self.transformer.get()
        h, w, steps = job.h, job.w, job.steps_run
        # Everything that depends only on shapes is built once, outside the loop.
        sigmas = FluxSampler().timesteps(h * w, job.steps)[job.t_start :]  # img2img skips the first t_start
        # KV variant with references: the references leave the sequence; their K/V come from a cache
        # filled at the first step and dropped with this image (other variants never cache).
        use_kv = self.info.reference_kv and job.ref_tokens is not None
        kv_cache = None
        plain_refs = job.ref_ids is not None and not use_kv
        img_ids = mx.concatenate([image_ids(h, w), job.ref_ids], axis=0) if plain_refs else image_ids(h, w)
        rope = model.compute_rope(text_ids(job.ctx.shape[1]), img_ids)
        txt = model.embed_text(job.ctx)  # step-invariant text projection, hoisted out of the loop
        B = job.ctx.shape[0]
        ref = None if job.ref_tokens is None else mx.broadcast_to(job.ref_tokens, (B,) + job.ref_tokens.shape[1:])
        x = job.x
        for i in range(steps):
            t_step = time.perf_counter()
            x_in = mx.broadcast_to(x, (B,) + x.shape[1:])
            if use_kv and kv_cache is None:
                kv_cache = model.reference_kv(ref, job.ref_ids, low_memory=self.low_memory)  # the extract step
                mx.eval(kv_cache.arrays())
                job.stats["reference_kv"] = {"seconds": time.perf_counter() - t_step, "bytes": kv_cache.nbytes}
            elif plain_refs:
                x_in = mx.concatenate([x_in, ref], axis=1)  # [target; refs]
            # diffusers' timestep path: sigma*1000 in the latent dtype, then /1000 (bf16-coarse, spec 2.3)
            t = mx.full((B,), sigmas[i] * 1000.0, dtype=mx.float32).astype(self.dtype) / 1000.0
            v = model.forward_with_rope(
                x_in, job.ctx, t, rope, txt_embedded=txt, low_memory=self.low_memory, reference_kv=kv_cache
            )
            v = v[:, : h * w]  # predictions for the target tokens only (refs are context)
            if job.guidance is not None:
                v = v[1:2] + job.guidance * (v[0:1] - v[1:2])  # uncond + s * (cond - uncond)
            x0 = x - sigmas[i] * v  # flow matching: x_t = (1 - s) x0 + s noise, v = noise - x0
            x = FluxSampler.step(x, v, sigmas[i], sigmas[i + 1])
            if job.mask is not None:  # inpainting: the kept region is x0 noised to the next sigma
                x = blend(x, job.x0, job.prior, job.mask, sigmas[i + 1] if i + 1 < steps else None)
            finite = mx.all(mx.isfinite(x))
            mx.eval(x, finite)
            if not finite.item():
                raise FluxKleinError(f"non-finite values appeared at denoising step {i + 1}: {self._nan_hint()}")
            job.x = x
            yield Progress("denoise", i + 1, steps, time.perf_counter() - t_step, stats=job.stats, denoised=x0,
                           grid=(h, w))
        seconds = time.perf_counter() - t_stage
        job.stats["denoise"] = {"seconds": seconds, "peak_memory": mx.get_peak_memory(), "seconds_per_step": seconds / steps}
        del model, kv_cache
        if self.low_memory:
            self.transformer.release()

    def decode(self, job: Job, output_type: str = "pil"):
        """Stage 3: denormalise -> unpatchify -> VAE decoder -> PIL image or float array."""
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        # Low-memory mode decodes in row bands (same result, bounded activation peak).
        decoded = self.vae.get().decode_tokens(job.x, job.h, job.w, tiled=self.low_memory)
        self._check_finite(decoded, "the VAE decode")  # never a black or garbage PNG from NaN
        image = to_output(decoded, output_type)
        stats = job.stats
        stats["decode"] = {"seconds": time.perf_counter() - t0, "peak_memory": mx.get_peak_memory()}
        if self.low_memory:
            self.vae.release()  # so the next image's denoise holds the transformer alone
        stats["total_seconds"] = sum(stats[s]["seconds"] for s in ("encode", "denoise", "decode"))
        return image

    def generate(
        self,
        prompt: str,
        *,
        width: int | None = None,
        height: int | None = None,
        steps: int | None = None,
        guidance: float | None = None,
        seed: int | None = None,
        images: Sequence | None = None,
        negative_prompt: str | None = None,
        latents=None,
        output_type: str = "pil",
        noise: str = "torch",
        init_image=None,
        strength: float | None = None,
        mask=None,
    ):
        """Generate one image.

        Args:
            prompt: the text prompt.
            width, height: output size in pixels, multiples of 16 (default 1024x1024; with
                reference images and no size given, the first reference's processed size).
            steps: denoising steps (default: 4 for distilled models, 50 for Base).
            guidance: CFG scale for Base models (default 4.0); ignored, with a warning, by
                distilled models.
            seed: seed of the initial noise; random when None. Taken modulo 2**32 for torch noise.
            images: reference image(s) for editing / multi-reference (PIL images or paths).
            negative_prompt: the unconditional prompt of CFG (Base models; default "").
            latents: initial noise in diffusers' layout (1, 128, H/16, W/16), instead of a seed
                (with an init image it is the noise that `strength` mixes in).
            output_type: "pil" (PIL image) or "np" (float32 array (H, W, 3) in [0, 1]).
            noise: "torch" (default): the noise `torch.randn` draws on the CPU for this seed, so
                diffusers' images for a seed reproduce; "mlx": MLX's noise, as mflux draws it.
            init_image: image-to-image: start from this image (PIL or path) instead of pure
                noise, as diffusers' Flux2KleinInpaintPipeline does; the output takes its size
                (area capped at 1024^2 px, sides resized to multiples of 16). It is also the first
                reference image; `images` follow it.
            strength: how far from the init image to go, in (0, 1] (default 0.8); 1 starts from
                pure noise. int(steps * strength) or so of the steps run (diffusers' convention).
            mask: inpainting: a mask the size of the init image; white is repainted, black kept.
        """
        event = None
        for event in self.stream(
            prompt, width=width, height=height, steps=steps, guidance=guidance, seed=seed, images=images,
            negative_prompt=negative_prompt, latents=latents, output_type=output_type, noise=noise,
            init_image=init_image, strength=strength, mask=mask,
        ):
            pass
        self.last_stats = event.stats
        return event.image


DEFAULT_MODEL = "black-forest-labs/FLUX.2-klein-4B"


def load(
    model: str | Path = DEFAULT_MODEL,
    *,
    dtype: str = "bfloat16",
    quantize: int | None = None,
    group_size: int = 64,
    low_memory: bool = False,
    loras: list | None = None,
    lora_partial: bool = False,
) -> FluxKleinPipeline:
    """Load a FLUX.2 [klein] pipeline.

    Args:
        model: a Hugging Face repo id (e.g. "black-forest-labs/FLUX.2-klein-4B", resolved through
            the hub cache, downloading only the files the pipeline needs), a local folder in the
            diffusers layout of the klein repos, or a folder written by `convert`.
        dtype: "bfloat16" (default), "float16" or "float32" for weights and activations.
        quantize: 4 or 8 to quantize the transformer and text encoder at load (a folder that is
            already quantized keeps its own quantization).
        group_size: quantization group size (64).
        low_memory: evaluate the transformer block by block (lower activation peak), release it
            before the VAE decode (it reloads next time) and decode in row bands, which bounds the
            decoder's activation memory. With `quantize=4` this keeps a klein-4B 1024^2
            generation near 3 GB.
        loras: LoRA files for the transformer, each a path (or `owner/name`, `owner/name:file.safetensors`
            on the Hugging Face hub) or `(path, scale)`; scale defaults to 1.0. Fused into float
            weights, a side path beside quantized ones; change them later with `set_loras`.
        lora_partial: accept LoRAs of which only some modules match the model (refused otherwise).

    The variant (4B/9B, distilled/Base, 9B-KV) is read from the files. Models load on first use.
    """
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise FluxKleinError(f"model must be a repo id or a path (str or Path), not {model!r}")
    if not isinstance(dtype, (str, mx.Dtype)):
        raise FluxKleinError(f"dtype must be one of 'bfloat16', 'float16', 'float32', not {dtype!r}")
    dt = as_dtype(dtype)
    for what, value in (("quantize", quantize), ("group_size", group_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            choices = "4, 8 or None" if what == "quantize" else "32, 64 or 128"
            raise FluxKleinError(f"{what} must be a whole number ({choices}), not {value!r}")
    if quantize is not None:
        check_quantization(int(quantize), int(group_size))
    info = describe(model)
    if info.format == "bfl":
        raise FluxKleinError(
            f"{info.path} is a single weight file; convert it into a model folder first: "
            f"python -m flux_klein_mlx convert --model {info.path} --output DIR"
        )
    stored = next((r for r in info.quantization.values() if r), None)
    if stored and quantize is not None and quantize != stored["bits"]:
        raise FluxKleinError(
            f"{info.path} is already quantized to {stored['bits']} bits; leave --quantize out, or quantize the "
            f"unquantized folder to {quantize} bits"
        )
    check_weights(info)  # every weight file's header, keys and shapes, before any model runs

    def component(name):
        return lambda: load_component(info, name, dt, quantize, group_size)

    parsed = load_loras(loras, info.params, lora_partial)  # every LoRA checked before any model loads
    return FluxKleinPipeline(
        component("transformer"), component("text_encoder"), lambda: load_tokenizer(info.tokenizer),
        component("vae"), info, dtype=dt, low_memory=low_memory,
        quantization=stored or ({"bits": quantize, "group_size": group_size} if quantize else None), loras=parsed,
    )  # fmt: skip
