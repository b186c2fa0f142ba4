"""The FLUX.2 [klein] pipeline: prompt -> embeddings -> 4 (or 50) flow steps -> VAE decode.

A run is three public stages, each timed (seconds, peak memory) into a typed `Stats`:

    job = pipe.prepare(inputs)       # prompt embeddings, reference / init-image tokens, the prior
    for event in pipe.denoise(job):  # one `Event` per step; job.x advances
        ...
    image = pipe.decode(job)         # VAE decode; the final event carries the image's metadata

`stream` is those three in a row and `generate` runs `stream` to the end. Models sit in slots,
loaded on first use; the text encoder is released once the prompt is encoded (embeddings of
recent prompts are kept, on disk too with a cache (`embedding_cache`): a run whose prompts are cached
never opens its files), and reference tokens of recent image sets are kept (one VAE encode for all
images of a batch). While a GPU computes, the next model's files are read ahead (`readahead.Prefetch`).
A `MemoryPlan` says what else is given up for memory (`low_memory=True` sets all of it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checks import check_choice, is_int
from ..dtypes import DEFAULT_DTYPE, DTYPES, as_dtype, dtype_name
from ..errors import FluxKleinError
from ..events import Event, Job, MemoryPlan, StageStats, Stats
from ..inputs.images import crop_to_box
from ..inputs.settings import PreparedInputs, RunSettings, prepare_inputs
from ..limits import check_decode_fits, untiled_decode_fits
from ..lora.apply import apply_loras, load_loras
from ..models.config import AutoEncoderConfig
from ..models.quantize import check_quantization
from ..models.rope import token_grid
from ..models.tokenizer import load_tokenizer
from ..record.a1111 import model_hash
from ..record.output import LatentPreview, image_metadata, model_name, preview_for, to_output
from ..sampling import blend, euler_step, initial_noise, pack_latents, scale_noise, x0_estimate
from ..storage.embedding_cache import DEFAULT_MAX_BYTES, EmbeddingCache, cached_embeddings, open_cache, prompt_keys
from ..storage.readahead import Prefetch
from ..upsample.cache import CaptionCache, revise
from .components import check_weights, load_component, read_component
from .loading import COMPONENTS, ModelInfo, check_for_loading, describe

DEFAULT_MODEL = "black-forest-labs/FLUX.2-klein-4B"
PROMPTS_KEPT = 8  # embeddings of recent prompts (each (1, 512, C): 7.5 MB for klein-4B in bf16)
IMAGE_SETS_KEPT = 4  # reference-token sets (each (1, L, 128): 1 MB per 1024^2 reference in bf16)


class FluxKleinPipeline:
    """Text-to-image, editing and multi-reference generation with a loaded klein model.

    Build it with `flux_klein_mlx.load(...)`. `loaders` maps "transformer", "text_encoder",
    "tokenizer" and "vae" to functions that load them.
    """

    def __init__(
        self,
        loaders: dict[str, Callable[[], object]],
        info: ModelInfo,
        *,
        dtype=mx.bfloat16,
        low_memory=False,
        quantization: dict | None = None,
        loras: list | None = None,
        cache: EmbeddingCache | None = None,
        check_files: Callable[[], None] | None = None,
        upsampler: str | Path | None = None,
    ):
        self.info = info
        self.dtype = dtype
        self.memory = MemoryPlan.of(low_memory)
        self.quantization = quantization  # {"bits", "group_size", ...} or None
        self.loras = list(loras or [])  # lora.Lora, applied whenever the transformer (re)loads
        self._loaders = dict(loaders, transformer=functools.partial(self._with_loras, loaders["transformer"]))
        self._models: dict[str, object] = {}
        self._load_seconds = 0.0  # all loads so far (stages take differences)
        self._prompts: OrderedDict[str, mx.array] = OrderedDict()  # prompt -> (1, 512, C)
        self._image_sets: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (tokens, ids)
        self._preview: LatentPreview | None = None
        self._open_streams = 0
        self.last_stats: Stats | None = None
        self.last_metadata: dict | None = None
        self.cache = cache  # prompt embeddings on disk (None: memory only)
        # Reading ahead pays where a GPU computes and the CPU cores are free; the CPU backend's compute
        # takes every core (measured on 2 cores: encode +3.4 s, loads no faster; RESULTS.md section 9).
        self.prefetch = Prefetch(info, enabled=mx.default_device() == mx.gpu)
        # Checks the text encoder's files before its first load; cached once it passes (a failure raises again).
        self._check_files = functools.cache(check_files or (lambda: None))
        self.upsampler = upsampler or info.family.upsampler  # FLUX 3's prompt upsampler: a folder or repo id
        self.on_caption: Callable | None = None  # told each piece of a caption being written (`upsample.runtime`)

    # ---- models -------------------------------------------------------------------------------

    def component(self, name: str):
        """The loaded `name` ("transformer", "text_encoder", "tokenizer" or "vae"), loading it if needed."""
        if name not in self._models:
            t0 = time.perf_counter()
            self._models[name] = self._loaders[name]()
            self._load_seconds += time.perf_counter() - t0
        self.prefetch.finish(name)  # loaded: what was not read ahead the load has read itself
        return self._models[name]

    def _read_ahead(self, name: str) -> None:
        """Read `name`'s files into the page cache on a background thread while something computes. Safe
        for memory: no MLX array, no bytes kept (4 reused 8 MiB buffers), only clean, reclaimable cache pages
        the load reads through anyway, capped to what fits beside the resident models (`readahead.Prefetch`);
        measured: the same peak MLX memory and RSS with and without it (benchmarks/RESULTS.md)."""
        if not self.is_loaded(name):
            self.prefetch.start(name, mx.get_active_memory())

    def is_loaded(self, name: str) -> bool:
        return name in self._models

    def release(self, name: str) -> None:
        """Drop a model to free its memory; it loads again when next needed."""
        self._models.pop(name, None)
        mx.clear_cache()

    def load_seconds(self) -> float:
        """Seconds spent loading models since this pipeline was made (stages report their part)."""
        return self._load_seconds

    def preview_map(self) -> LatentPreview:
        """The latent -> RGB map of step previews for this model's VAE (output.preview_for)."""
        if self._preview is None:
            self._preview = preview_for(self.component("vae"))
        return self._preview

    def _with_loras(self, loader: Callable[[], object]):
        model = loader()
        if self.loras:
            # Kept originals are lazy arrays of the model's files: a LoRA costs its own size either way.
            apply_loras(model, self.loras, keep_originals=not self.memory.drop_lora_originals, reread=self._reread())
        return model

    def _reread(self) -> Callable[[str], mx.array] | None:
        """Original float weights of transformer layers, lazily from the files (None: no files)."""
        if self.info.format not in ("diffusers", "mlx"):
            return None
        weights = read_component(self.info, "transformer")  # lazy: nothing is read until evaluated
        return lambda path: weights[f"{path}.weight"].astype(self.dtype)

    def set_loras(self, loras, partial: bool = False) -> None:
        """Replace the applied LoRAs, e.g. `["a.safetensors", ("b.safetensors", 0.8)]`; `[]` removes them.

        The base model is not reloaded: fused LoRAs are unfused exactly, side paths dropped (without
        kept originals the transformer is released instead). Every file is read and checked first;
        on any error the pipeline keeps its previous LoRAs. Refused while a `stream()` is open.
        """
        if self._open_streams:
            raise FluxKleinError("set_loras was called while a stream() is running; finish or close it first")
        parsed = load_loras(loras, self.info.params, partial)
        if self.is_loaded("transformer") and self.memory.drop_lora_originals:
            self.release("transformer")
        elif self.is_loaded("transformer"):
            apply_loras(self.component("transformer"), parsed)
        self.loras = parsed

    # ---- conditioning -------------------------------------------------------------------------

    def encode_prompts(self, prompts: Sequence[str]) -> mx.array:
        """Embeddings (B, L, C) for `prompts` of one window length (FLUX.2: (B, 512, 3*hidden)), from
        `prompt_embeddings`."""
        return mx.concatenate(self.prompt_embeddings(prompts), axis=0)

    def prompt_embeddings(self, prompts: Sequence[str]) -> list[mx.array]:
        """Embeddings (1, L, C) of each prompt: kept in memory, else read from the disk cache, else made
        by the text encoder (loaded once for all of them, then released) and stored."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._prompts]
        if missing:
            found = cached_embeddings(self.cache, self._cache_keys(missing), self._run_text_encoder)
            for p in missing:
                self.remember_prompt(p, found[p])
        for p in prompts:
            self._prompts.move_to_end(p)
        return [self._prompts[p] for p in prompts]

    def _run_text_encoder(self, prompts: list[str]) -> list[mx.array]:
        """(1, L, C) embeddings of each of `prompts` from the text encoder, checked finite (never cached otherwise)."""
        self._check_files()
        encoder = self.component("text_encoder")
        tokenizer = self.component("tokenizer")
        self._read_ahead("transformer")  # its files are read while the encoder computes
        emb = [e.astype(self.dtype) for e in self.info.family.encode_prompts(encoder, tokenizer, prompts)]
        mx.eval(emb)
        for e in emb:
            self._check_finite(e, "the text encoder's prompt embeddings")
        del encoder
        self.release("text_encoder")
        return emb

    def _cache_keys(self, prompts: list[str]) -> dict[str, str | None]:
        if self.cache is None or not prompts:
            return {p: None for p in prompts}
        # FLUX 3's taps and window are part of what it encodes (FLUX.2's adds nothing: its keys stay as they were)
        settings = {"dtype": dtype_name(self.dtype), "quantization": self.quantization, **self.info.family.text_key}
        return prompt_keys(
            self.cache,
            self.info.files["text_encoder"],
            tokenizer=self.info.tokenizer,
            prompts=prompts,
            settings=settings,
        )

    def check_text_encoder(self, inputs: PreparedInputs | None = None) -> bool:
        """Check the text encoder's files (headers) now, unless every prompt of `inputs` is cached:
        those are read into memory and the encoder's files are never opened. `generate` calls it
        before it prints anything, the server at its start (`None`: check). True: the encoder will run."""
        prompts = [] if inputs is None else inputs.prompts
        missing = [p for p in dict.fromkeys(prompts) if p not in self._prompts]
        for p, key in self._cache_keys(missing).items():
            if key is not None and (hit := self.cache.get(key)) is not None:
                self.remember_prompt(p, hit)
        if needed := inputs is None or any(p not in self._prompts for p in prompts):
            self._check_files()
        return needed

    def remember_prompt(self, prompt: str, embeddings: mx.array) -> None:
        """Use `embeddings` (1, 512, C) for `prompt` from now on instead of running the text encoder."""
        self._prompts[prompt] = embeddings.astype(self.dtype)
        while len(self._prompts) > PROMPTS_KEPT:
            self._prompts.popitem(last=False)

    def encode_images(self, pixels: list[np.ndarray], key: str, what: str) -> tuple[mx.array, mx.array]:
        """VAE-encode images (each (H, W, 3) in [-1, 1]) -> tokens (1, sum h_k*w_k, 128) and RoPE ids.

        Image k gets the family's reference ids (FLUX.2: time 10 (k + 1)). Results are kept by `key` (the
        pixels' content hashes), so the images of a batch are encoded once.
        """
        cache_key = (key, str(self.dtype))
        if cache_key not in self._image_sets:
            vae = self.component("vae")
            tokens = [vae.encode_to_tokens(mx.array(p)[None].astype(self.dtype)) for p in pixels]  # (1, H/16*W/16, 128)
            ids = [self.info.family.reference_ids(k, *token_grid(p.shape[1], p.shape[0])) for k, p in enumerate(pixels)]
            out = mx.concatenate(tokens, axis=1), mx.concatenate(ids, axis=0)
            mx.eval(out)
            self._check_finite(out[0], f"the VAE encoding of {what}")
            self._image_sets[cache_key] = out
            while len(self._image_sets) > IMAGE_SETS_KEPT:
                self._image_sets.popitem(last=False)
        self._image_sets.move_to_end(cache_key)
        return self._image_sets[cache_key]

    def _nan_hint(self) -> str:
        if self.dtype == mx.float32:
            return "the weights are probably damaged (the run is already float32); download or convert them again"
        return "the weights may be damaged, or the values overflow this dtype: try --dtype float32 (dtype='float32')"

    def _check_finite(self, x: mx.array, stage: str) -> None:
        if not mx.all(mx.isfinite(x)).item():
            raise FluxKleinError(f"non-finite values in {stage}: {self._nan_hint()}")

    # ---- the run ------------------------------------------------------------------------------

    def inputs(self, prompt, settings: dict) -> PreparedInputs:
        """`stream`'s first argument (a prompt, a `RunSettings` or `PreparedInputs`) + keywords, checked."""
        if isinstance(prompt, PreparedInputs):
            if settings:
                raise FluxKleinError("give settings either in PreparedInputs or as keywords, not both")
            prepared = prompt
        elif isinstance(prompt, RunSettings):
            prepared = prepare_inputs(dataclasses.replace(prompt, **settings), self.info)
        else:
            prepared = prepare_inputs(RunSettings.from_keywords(prompt, settings), self.info)
        if prepared.upsample is not None:  # the caption first, the transformer dropped if the upsampler must load
            captions, room = CaptionCache.beside(self.cache), functools.partial(self.release, "transformer")
            prepared = revise(prepared, self.upsampler, captions, on_progress=self.on_caption, make_room=room)
        # RunSettings checked the size for klein's decoder in bfloat16; this is this pipeline's decoder and dtype
        vae = AutoEncoderConfig.from_dict(self.info.configs["vae"])
        check_decode_fits(prepared.settings.width, prepared.settings.height, self.dtype.size, vae)
        return prepared

    def stream(self, prompt, **settings) -> Iterator[Event]:
        """Run a generation, yielding an `Event` after encoding, after every step and at the end.

        `prompt` is the prompt (settings as keywords: see `inputs.RunSettings`), a `RunSettings`, or
        the `PreparedInputs` of one. The final event (stage "decode") carries the image and its
        metadata. Breaking out of the loop stops the run between steps.
        """
        inputs = self.inputs(prompt, settings)
        self._open_streams += 1
        try:
            job = self.prepare(inputs)
            yield Event(
                stage="encode", step=0, total=inputs.steps_run, seconds=job.stats.encode.seconds, stats=job.stats
            )
            yield from self.denoise(job)
            image = self.decode(job, inputs.settings.output_type)
            n = inputs.steps_run
            yield Event(
                stage="decode",
                step=n,
                total=n,
                seconds=job.stats.decode.seconds,
                stats=job.stats,
                image=image,
                metadata=self.last_metadata,
            )
        finally:
            self._open_streams -= 1

    def generate(self, prompt, **settings):
        """Generate one image: `generate(prompt, width=, height=, steps=, guidance=, seed=, images=,
        negative_prompt=, latents=, output_type=, noise=, init_image=, strength=, mask=)`, each
        explained in `inputs.RunSettings`. Returns a PIL image (or a float32 array for
        output_type="np"); `last_stats` and `last_metadata` describe it."""
        for event in self.stream(prompt, **settings):  # noqa: B007  (run to the end: the last event carries the image)
            pass
        return event.image

    def prepare(self, prompt, **settings) -> Job:
        """Stage 1: encode the prompt(s), the init image and references, and draw the noise."""
        inputs = self.inputs(prompt, settings)
        run = inputs.settings
        init = inputs.init
        mx.reset_peak_memory()
        t0, loads = time.perf_counter(), self.load_seconds()
        ctx = self.prompt_embeddings(inputs.prompts)  # each (1, L, C): [cond, uncond] with CFG
        self._read_ahead("transformer")  # prompts cached: read while the references are encoded
        h, w = token_grid(run.width, run.height)
        ref_tokens = ref_ids = x0 = None
        # The init image is x0 and the first reference (t = 10); other references follow at 20, 30, ...
        pixels = ([init.pixels] if init is not None else []) + inputs.references
        if pixels:
            what = "the init image" if init is not None else "the reference image(s)"
            ref_tokens, ref_ids = self.encode_images(pixels, inputs.images_key, what)
            x0 = ref_tokens[:, : h * w] if init is not None else None
        stats = Stats(encode=self.stage_stats(t0, loads), upsample_seconds=inputs.upsample_seconds)
        # Noise in the normalised, patchified latent space: (1, C, h, w) -> tokens (1, h*w, C).
        if inputs.latents is None:
            prior = pack_latents(initial_noise((1, self.info.in_channels, h, w), run.seed, run.noise))  # float32
        else:
            prior = pack_latents(mx.array(inputs.latents))
        # The schedule (and its mu) is built for all steps; img2img starts t_start steps in (diffusers' get_timesteps).
        sigmas = self.info.family.sigmas(h * w, run.steps)[inputs.t_start :]
        x = prior if init is None else scale_noise(x0, prior, sigmas[0])  # the init image noised to the first sigma
        mask = None if init is None or init.mask is None else mx.array(init.mask)[None]  # (1, h*w, 1)
        return Job(
            inputs=inputs,
            x=x.astype(self.dtype),
            ctx=ctx,
            ref_tokens=ref_tokens,
            ref_ids=ref_ids,
            prior=prior,
            sigmas=sigmas,
            x0=x0,
            mask=mask,
            stats=stats,
        )

    def denoise(self, job: Job) -> Iterator[Event]:
        """Stage 2: the flow steps, a generator that yields after every step; `job.x` advances."""
        mx.reset_peak_memory()
        t_stage, loads = time.perf_counter(), self.load_seconds()
        n, sigmas = job.inputs.steps_run, job.sigmas
        # Everything that depends only on shapes is built once, outside the loop, by the model's family.
        steps = self.info.family.steps(
            self.component("transformer"),
            job,
            dtype=self.dtype,
            reference_kv=self.info.reference_kv,
            low_memory=self.memory.blockwise,
        )
        x = job.x
        for i in range(n):
            t_step = time.perf_counter()
            if i == n - 1:
                self._read_ahead("vae")  # read during the last step, so the decode finds it cached
            v = steps.velocity(x, i)
            denoised = x0_estimate(x, v, sigmas[i])
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
            if job.mask is not None:  # inpainting: the kept region is x0 noised to the next sigma
                x = blend(x, job.x0, job.prior, mask=job.mask, sigma_next=sigmas[i + 1] if i + 1 < n else None)
            finite = mx.all(mx.isfinite(x))
            mx.eval(x, finite)
            if not finite.item():
                raise FluxKleinError(f"non-finite values appeared at denoising step {i + 1}: {self._nan_hint()}")
            job.x = x
            yield Event(
                stage="denoise",
                step=i + 1,
                total=n,
                seconds=time.perf_counter() - t_step,
                stats=job.stats,
                denoised=denoised,
                grid=job.grid,
            )
        stage = job.stats.denoise = self.stage_stats(t_stage, loads)
        job.stats.seconds_per_step = (stage.seconds - stage.load_seconds) / n  # the steps' own rate, without loads
        del steps  # the model and a reference K/V cache go with it
        if self.memory.release_models:
            self.release("transformer")

    def stage_stats(self, t0: float, loads: float) -> StageStats:
        """A stage's seconds since `t0`, its MLX peak, and the part spent loading (`loads`: load seconds at t0)."""
        seconds, loaded = time.perf_counter() - t0, self.load_seconds() - loads
        return StageStats(seconds=seconds, peak_memory=mx.get_peak_memory(), load_seconds=loaded)

    def decode(self, job: Job, output_type: str = "pil"):
        """Stage 3: denormalise -> unpatchify -> VAE decoder -> PIL image or float array."""
        mx.reset_peak_memory()
        t0, loads = time.perf_counter(), self.load_seconds()
        vae = self.component("vae")
        h, w = job.grid  # past what the whole-image decode can hold (limits.py), bands: the same image
        width, height = job.inputs.settings.width, job.inputs.settings.height
        tiled = self.memory.tiled_decode or not untiled_decode_fits(vae.config, width, height)
        decoded = vae.decode_tokens(job.x, h, w, tiled=tiled)
        self._check_finite(decoded, "the VAE decode")  # never a black or garbage PNG from NaN
        if job.inputs.crop is not None:  # FLUX 3, one reference: its canvas cropped back to it
            decoded = crop_to_box(decoded[0], job.inputs.crop)[None]
        image = to_output(decoded, output_type)
        if job.inputs.outpaint is not None:  # the original's pixels back outside the seam
            image = job.inputs.outpaint.composite(image)
        job.stats.decode = self.stage_stats(t0, loads)
        if self.memory.release_models:
            self.release("vae")  # so the next image's denoise holds the transformer alone
        self.last_stats = job.stats
        self.last_metadata = self.metadata(job.inputs)
        return image

    def metadata(self, inputs: PreparedInputs) -> dict:
        """The record of an image made from `inputs` by this pipeline (output.image_metadata)."""
        hashes = inputs.hashes
        return image_metadata(
            inputs.settings,
            model=model_name(self.info.source),
            variant=self.info.name,
            dtype=dtype_name(self.dtype),
            quantize=self.quantization["bits"] if self.quantization else None,
            loras=[lora.record() for lora in self.loras],
            references=hashes["references"],
            init_image=hashes.get("init_image"),
            mask=hashes.get("mask"),
            steps_run=inputs.steps_run,
            vae=self.info.vae_source and model_name(self.info.vae_source),
            model_hash=model_hash(self.info.files.get("transformer") or []),
            crop=inputs.crop,
            typed_prompt=inputs.typed_prompt,
            boxes=inputs.boxes,
        )


def model_loaders(info: ModelInfo, dtype: mx.Dtype, *, quantize: int | None, group_size: int) -> dict:
    """A loader for each component of `info` (the pipeline's lazy slots: nothing is read yet)."""
    loaders = {
        n: functools.partial(load_component, info, n, dtype, quantize=quantize, group_size=group_size)
        for n in COMPONENTS
    }
    loaders["tokenizer"] = lambda: load_tokenizer(info.tokenizer)
    return loaders


def _check_load_options(model, *, vae, dtype, quantize, group_size) -> None:
    for what, value in (("model", model), ("vae", vae)):
        if what == "vae" and value is None:
            continue  # the model's own VAE
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise FluxKleinError(f"{what} must be a repo id or a path (str or Path), not {value!r}")
    if not isinstance(dtype, mx.Dtype):
        check_choice("dtype", dtype, DTYPES)
    for what, value, choices in (("quantize", quantize, "4, 8 or None"), ("group_size", group_size, "32, 64 or 128")):
        if value is not None and not is_int(value):
            raise FluxKleinError(f"{what} must be a whole number ({choices}), not {value!r}")
    if quantize is not None:
        check_quantization(int(quantize), int(group_size))


def load(
    model: str | Path = DEFAULT_MODEL,
    *,
    dtype: str = DEFAULT_DTYPE,
    quantize: int | None = None,
    group_size: int = 64,
    low_memory: bool | MemoryPlan = False,
    loras: list | None = None,
    lora_partial: bool = False,
    vae: str | Path | None = None,
    cache: bool | EmbeddingCache = True,
    cache_size: int | str = DEFAULT_MAX_BYTES,
    upsampler: str | Path | None = None,
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
        low_memory: True evaluates the transformer block by block, releases it before the VAE
            decode (it reloads next time), decodes in row bands and keeps no LoRA originals; with
            `quantize=4` a klein-4B 1024^2 generation stays near 3 GB. A `MemoryPlan` picks parts.
        loras: LoRA files for the transformer, each a path (or `owner/name`, `owner/name:file.safetensors`
            on the Hugging Face hub) or `(path, scale)`; scale defaults to 1.0. Fused into float
            weights, a side path beside quantized ones; change them later with `set_loras`.
        lora_partial: accept LoRAs of which only some modules match the model (refused otherwise).
        vae: another VAE in place of the model's, or only its decoder: a repo id such as
            "black-forest-labs/FLUX.2-small-decoder", a folder or a .safetensors file (`loading.with_vae`).
        cache: keep prompt embeddings on disk (in `$FLUX_KLEIN_CACHE`, else `$XDG_CACHE_HOME/flux_klein_mlx`,
            else `~/.cache/flux_klein_mlx`): a prompt seen before never loads the text encoder. False: off.
        cache_size: the disk cache's bound, bytes or text such as "1GB" (least recently used go first); 0: off.
        upsampler: FLUX 3's prompt upsampler for `upsample=True` (folder or repo id; default BFL's pup).

    The variant (4B/9B, distilled/Base, 9B-KV) is read from the files; models load on first use."""
    _check_load_options(model, vae=vae, dtype=dtype, quantize=quantize, group_size=group_size)
    prompt_cache = open_cache(cache, cache_size)
    info = describe(model, vae=vae)
    check_for_loading(info, quantize)
    # Every weight file's header, keys and shapes, before any model runs; the text encoder's just before
    # it first loads (it is the first model to run), so that a run whose prompts are cached never opens them.
    check_weights(info, ("transformer", "vae"))
    parsed = load_loras(loras, info.params, lora_partial)  # every LoRA checked before any model loads
    loaders = model_loaders(info, dt := as_dtype(dtype), quantize=quantize, group_size=group_size)
    quantization = info.stored_quantization or ({"bits": quantize, "group_size": group_size} if quantize else None)
    return FluxKleinPipeline(
        loaders,
        info,
        dtype=dt,
        low_memory=MemoryPlan.of(low_memory),
        quantization=quantization,
        loras=parsed,
        cache=prompt_cache,
        check_files=lambda: check_weights(info, ("text_encoder",)),
        upsampler=upsampler,
    )
