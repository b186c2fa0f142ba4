"""Sample images while a LoRA trains, on the model it will run on, exactly as `generate` makes them.

    samples/step-000000-K.png        sample prompt K without the LoRA (the baseline), before step 1
    samples/step-000100-K.png        prompt K with the LoRA as it is at step 100 (strength 1)
    samples/step-000100-K-x0.5.png   the same at strength 0.5 (--sample-strengths 0.5,1)

The sample model (`--sample-model`) defaults to the distilled sibling of a published Base repo id
(FLUX.2-klein-base-4B -> FLUX.2-klein-4B, the 4-step model LoRAs are run on), else the training
model. Samples go through the public `pipeline.load` at `generate`'s defaults: bfloat16, no
quantization (unless --sample-quantize), the sample model's own steps and guidance, the torch noise
of --sample-seed, --resolution² pixels (the largest of several; or --sample-size²). At each sample point
the LoRA is kept beside the images as the file the run delivers (--format, --save-dtype, the training
header; the EMA under --ema), and the samples are drawn with that file:

    samples/step-000100.safetensors  the LoRA of step 100, as the output would be written at step 100

so a sample is what

    generate --model M --lora <work>/samples/step-000100.safetensors --prompt P --seed S --width W --height W

gives, and the last sample (at --steps) is what the output gives; each PNG's record carries that
command, the file's sha256 and whether a checkpoint was written at that step (`training_sample`).
An edit LoRA's samples (--control) are edits of reference images (`sample_references`: --sample-image,
else the first held-out image's references), named in the record and given to that command as --image.
A small file rather than a checkpoint kept from deletion: a checkpoint holds the float32 adapters
and AdamW's two moments (about 6x the bytes of a bfloat16 LoRA), and its float32 LoRA is not the
precision the user gets.

The pipeline computes as `generate` does (whole-model evaluation, untiled decode: low_memory's
blockwise evaluation and tiled decode round bfloat16 differently, several /255 on a tiny model),
but holds one model at a time: its text encoder runs once (before the training model loads), its
transformer and VAE are released after each image; the training model stays as it is. Each
sample point reports how much the LoRA changes each baseline image (mean |pixel difference|, 0-255)
and the memory peak of its images, with what that adds over the training steps' peak.
"""

from __future__ import annotations

import shlex
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image

from ... import __version__
from ...dtypes import DEFAULT_DTYPE, as_dtype
from ...errors import FluxKleinError
from ...family import FAMILIES
from ...lora import layouts
from ...models.quantize import already_quantized
from ...record.output import read_record, write_image
from ...run.components import check_weights
from ...run.loading import ModelInfo, describe
from ...storage.weights import save_safetensors_streaming
from ..data.dataset import check_picture
from ..settings import TrainSettings
from ..state import write_atomic

# A LoRA whose samples differ from the baseline by less than this mean |pixel difference| (of 255)
# changes almost nothing: at strength 1 a LoRA that has learned anything moves far more pixels.
WEAK_CHANGE = 1.0


@dataclass(kw_only=True)
class SamplesSaved:
    step: int
    paths: list[Path]
    changes: list[float | None]  # per image: mean |pixel - its baseline| in 0-255 (None: a baseline)
    strengths: list[float | None]  # per image: the LoRA strength (None: a baseline)
    peak_memory: int  # bytes: the highest stage peak of these images (the training model resident)
    added_memory: int | None  # bytes over the training steps' peak so far (None: before step 1)
    model: str  # the sample model's name
    kept: bool = False  # the baseline of the run's first start, read back on resume (not redrawn)


def sibling_model(model) -> str | None:
    """The distilled repo id of a published klein Base repo id (FLUX.2-klein-base-4B -> FLUX.2-klein-4B,
    flux-3-image-klein-base -> flux-3-image-klein), else None."""
    return next((repo for f in FAMILIES.values() if (repo := f.distilled_repo(str(model))) is not None), None)


def sample_source(settings: TrainSettings) -> str:
    """Where samples are drawn: --sample-model, else the distilled sibling of a Base repo id, else --model."""
    if settings.sample_model is not None:
        return str(settings.sample_model)
    return sibling_model(settings.model) or str(settings.model)


def check_sample_model(settings: TrainSettings, trained: ModelInfo) -> ModelInfo | None:
    """The sample model, described and checked (configs and headers only; no model loads); None: no samples."""
    if not settings.sample_every and not settings.sample_every_epochs:
        return None
    source = sample_source(settings)
    try:
        info = describe(source)
    except FluxKleinError as e:
        raise FluxKleinError(f"--sample-model {source}: {e}") from None
    if info.format == "bfl":
        raise FluxKleinError(f"--sample-model {source} is a single weight file; convert it into a model folder first")
    family = trained.family
    if info.family is not family or family.size_key(info.params) != family.size_key(trained.params):
        raise FluxKleinError(
            f"--sample-model {source} is {info.params.describe()}, but the LoRA trains on {trained.params.describe()}; "
            "give a klein model of the same size (the distilled model of the same family)"
        )
    stored = next((r for r in info.quantization.values() if r), None)
    if stored and settings.sample_quantize is not None and settings.sample_quantize != stored["bits"]:
        raise already_quantized(f"--sample-model {source}", stored["bits"], "leave --sample-quantize out")
    try:
        check_weights(info)
    except FluxKleinError as e:
        raise FluxKleinError(f"--sample-model {source}: {e}") from None
    return info


def sample_references(settings: TrainSettings, items: list, held_out: list) -> list[list[Path]]:
    """The reference images of each sample prompt (edit LoRAs, --control; [] each otherwise), every one
    opened and checked: --sample-image (one per --control for every prompt, or for each prompt in turn),
    else the first held-out image's references (--validation-control: images the LoRA never trained
    on), else the first training image's, said in a warning (the LoRA has seen that pair)."""
    prompts = len(settings.sample_prompts)
    n = len(settings.controls)
    if not n or not (settings.sample_every or settings.sample_every_epochs):
        return [[] for _ in range(prompts)]
    if settings.sample_images:
        paths = [Path(p).expanduser() for p in settings.sample_images]
        for p in paths:
            if not p.is_file():
                raise FluxKleinError(f"--sample-image {p} is not a file; give a reference image for the samples")
            check_picture(p, "--sample-image")
        return [paths[k * n : (k + 1) * n] for k in range(prompts)] if len(paths) > n else [paths] * prompts
    if held_out and held_out[0].controls:
        return [[c.path for c in held_out[0].controls]] * prompts
    first = items[0]
    warnings.warn(
        f"the samples of this edit LoRA edit {first.controls[0].path.name}, the reference of training image "
        f"{first.image.path.name} (give --sample-image, or --validation-control, for one it never trained on)",
        stacklevel=3,
    )
    return [[c.path for c in first.controls]] * prompts


def generate_command(
    record: dict, source: str, lora: Path | None, *, strength: float | None = None, references: list[Path] = ()
) -> str:
    """The `generate` command line that makes the image of `record` (a sample's own settings)."""
    args = ["python", "-m", "flux_klein_mlx", "generate", "--model", source, "--prompt", record["prompt"]]
    for option in ("seed", "width", "height", "steps"):  # the record's keys are the options' names
        args += [f"--{option}", str(record[option])]
    if record["quantize"]:
        args += ["--quantize", str(record["quantize"])]
    for image in references:
        args += ["--image", str(image)]
    if lora is not None:
        args += ["--lora", str(lora)] + (["--lora-scale", f"{strength:g}"] if strength != 1.0 else [])
    return shlex.join(args)


def sample_name(step: int, k: int, strength: float | None) -> str:
    tail = "" if strength in (None, 1.0) else f"-x{strength:g}"
    return f"step-{step:06d}-{k}{tail}.png"


class SampleImages:
    """The sample pipeline of a run: loaded once, its prompts encoded once, then an image per prompt
    (and strength) at each sample point; the baseline images are kept for the comparisons."""

    def __init__(self, settings, info: ModelInfo, references: list[list[Path]] | None = None):
        self.settings = settings
        self.info = info
        # per prompt, its reference images (an edit LoRA's; `sample_references`)
        self.references = references or [[] for _ in settings.sample_prompts]
        self.source = sample_source(settings)
        self.size = settings.sample_size or max(settings.resolutions)  # several: the largest
        self.folder = Path(settings.work_dir) / "samples"
        self.pipe = None
        self.baselines: list[np.ndarray] = []  # per prompt, (H, W, 3) float32 in 0-255

    def generate_settings(self, k: int = 0) -> dict:
        """`generate`'s settings of sample prompt `k` (its references, if any)."""
        images = {"images": [str(p) for p in self.references[k]]} if self.references[k] else {}
        return {
            "width": self.size,
            "height": self.size,
            "steps": self.settings.sample_steps,
            "seed": self.settings.sample_seed,
            **images,
        }

    def load(self) -> tuple[float, str]:
        """Load the sample pipeline (headers only) and encode its prompts with its own text encoder,
        released after: run while no training model is resident. (seconds, what was done)."""
        from ...events import MemoryPlan
        from ...run.pipeline import load

        t0 = time.perf_counter()
        self.pipe = load(
            self.source,
            dtype=DEFAULT_DTYPE,
            quantize=self.settings.sample_quantize,
            low_memory=MemoryPlan(release_models=True, drop_lora_originals=True),
        )
        prompts = [
            p
            for k, prompt in enumerate(self.settings.sample_prompts)
            for p in self.pipe.inputs(prompt, self.generate_settings(k)).prompts
        ]
        mx.eval(self.pipe.encode_prompts(list(dict.fromkeys(prompts))))
        q = f", {self.settings.sample_quantize}-bit" if self.settings.sample_quantize else ""
        prompts = len(self.settings.sample_prompts)
        detail = f"{self.info.name} from {self.source} ({DEFAULT_DTYPE}{q}), {prompts} prompt(s) encoded"
        return time.perf_counter() - t0, detail

    def _image(self, k: int):
        """Prompt `k`'s image at the sample settings with the pipeline's current LoRAs: (PIL image, record, peak
        bytes)."""
        image = self.pipe.generate(self.settings.sample_prompts[k], **self.generate_settings(k))
        st = self.pipe.last_stats
        peak = max(st.encode.peak_memory, st.denoise.peak_memory, st.decode.peak_memory)
        return image, dict(self.pipe.last_metadata), peak

    def _save(self, name: str, image, record: dict) -> Path:
        self.folder.mkdir(exist_ok=True)
        path = self.folder / name
        write_atomic(path, lambda tmp: write_image(image, tmp, "PNG", record), self.settings.work_dir)
        return path

    def baseline_key(self) -> dict:
        """What decides the baseline images: the sample model, its prompts and settings, this package's version."""
        n = len(self.settings.sample_prompts)
        return {
            "source": self.source,
            "model": str(self.info.path),
            "prompts": list(self.settings.sample_prompts),
            "settings": [self.generate_settings(k) for k in range(n)],
            "quantize": self.settings.sample_quantize,
            "flux_klein_mlx": __version__,
        }

    def kept_baseline(self) -> SamplesSaved | None:
        """The baseline images an earlier start of this run drew with the same `baseline_key`, read back
        (PNG: the same pixels); None when any is missing, unreadable or drawn otherwise."""
        paths = [self.folder / sample_name(0, k, None) for k in range(len(self.settings.sample_prompts))]
        key = self.baseline_key()
        try:
            records = [read_record(p) or {} for p in paths]
            if any(r.get("training_sample", {}).get("drawn_with") != key for r in records):
                return None
            images = [np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) for p in paths]
        except (OSError, ValueError, AttributeError):
            return None
        self.baselines = images
        return self._baseline_saved(paths, peak=0, kept=True)

    def baseline(self, resumed: bool = False) -> SamplesSaved:
        """samples/step-000000-K.png: each prompt without the LoRA; a resume keeps those of the run's start
        when they were drawn with the same settings (`kept_baseline`)."""
        if resumed and (kept := self.kept_baseline()) is not None:
            return kept
        self.pipe.set_loras([])
        paths = []
        self.baselines = []
        peak = 0
        for k in range(len(self.settings.sample_prompts)):
            image, record, p = self._image(k)
            record["training_sample"] = {
                "step": 0,
                "strength": None,
                "baseline": True,
                "references": [str(r) for r in self.references[k]],
                "generate": generate_command(record, self.source, None, references=self.references[k]),
                "drawn_with": self.baseline_key(),  # a resume keeps this image while its key is the same
            }
            paths.append(self._save(sample_name(0, k, None), image, record))
            self.baselines.append(np.asarray(image, dtype=np.float32))
            peak = max(peak, p)
        return self._baseline_saved(paths, peak=peak)

    def _baseline_saved(self, paths: list[Path], *, peak: int, kept: bool = False) -> SamplesSaved:
        """The event of the baseline images at `paths` (no LoRA: no change, no strength; before step 1)."""
        n = len(paths)
        return SamplesSaved(
            step=0,
            paths=paths,
            changes=[None] * n,
            strengths=[None] * n,
            peak_memory=peak,
            added_memory=None,
            model=self.info.name,
            kept=kept,
        )

    def sample(self, step: int, lora, trained_peak: int, header: dict[str, str]) -> SamplesSaved:
        """Each prompt at each strength with `lora` (a train.adapters TrainableLoRA or TrainableLoKr) as it is at
        `step`, kept as samples/step-N.safetensors: the file the run delivers (--format, --save-dtype, the
        training `header`), so each sample's `generate` command reproduces it and the last is the output's."""
        kept = self.keep_lora(step, lora, header)
        checkpoint = Path(self.settings.work_dir) / f"checkpoint-{step:06d}" / "lora.safetensors"
        paths = []
        changes = []
        strengths = []
        peak = 0
        try:
            for strength in self.settings.sample_strengths:
                self.pipe.set_loras([(kept, strength)])
                for k in range(len(self.settings.sample_prompts)):
                    image, record, p = self._image(k)
                    record["loras"] = [{**r, "name": f"{kept.parent.name}/{kept.name}"} for r in record["loras"]]
                    record["training_sample"] = {
                        "step": step,
                        "strength": strength,
                        "baseline": False,
                        "lora": str(kept),
                        "checkpoint": str(checkpoint),
                        "checkpoint_written": checkpoint.is_file(),
                        "references": [str(r) for r in self.references[k]],
                        "generate": generate_command(
                            record, self.source, kept, strength=strength, references=self.references[k]
                        ),
                    }
                    paths.append(self._save(sample_name(step, k, strength), image, record))
                    changes.append(float(np.abs(np.asarray(image, dtype=np.float32) - self.baselines[k]).mean()))
                    strengths.append(strength)
                    peak = max(peak, p)
        finally:
            self.pipe.set_loras([])
        self._warn_if_weak(step, changes)
        return SamplesSaved(
            step=step,
            paths=paths,
            changes=changes,
            strengths=strengths,
            peak_memory=peak,
            added_memory=max(0, peak - trained_peak),
            model=self.info.name,
        )

    def keep_lora(self, step: int, lora, header: dict[str, str]) -> Path:
        """samples/step-N.safetensors: `lora` as the output is written (layout, dtype, header); replaced whole
        when the step is sampled again (a resume), never left in part."""
        settings = self.settings
        self.folder.mkdir(exist_ok=True)
        path = self.folder / sample_lora_name(step)
        tensors, metadata = layouts.adapter_file(
            lora.terms(),
            settings.format,
            lora.params,
            what=path.name,
            dtype=as_dtype(settings.save_dtype or settings.dtype),
            header=header,
        )
        # through a temporary name: a full disk is one line naming the way back, and no part of the file stays
        write_atomic(path, lambda tmp: save_safetensors_streaming(tmp, tensors, metadata=metadata), settings.work_dir)
        return path

    def _warn_if_weak(self, step: int, changes: list[float]) -> None:
        if changes and max(changes) < WEAK_CHANGE:
            warnings.warn(
                f"the LoRA at step {step} barely changes the samples on {self.info.name} "
                f"(at most {max(changes):.2f}/255 mean pixel difference from the baseline); if this lasts, raise "
                "--lr or --steps, or check --targets",
                stacklevel=2,
            )


def sample_lora_name(step: int) -> str:
    return f"step-{step:06d}.safetensors"
