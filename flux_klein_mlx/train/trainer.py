"""LoRA training for FLUX.2 [klein]: diffusers' flow-matching objective on a frozen transformer.

    for event in flux_klein_mlx.train_lora(model="black-forest-labs/FLUX.2-klein-base-4B",
                                           data="photos/", output="ink.safetensors", steps=500):
        print(event)

The objective is that of diffusers' `train_dreambooth_lora_flux2_klein.py` (docs/training.md (a)),
per batch of images that share a bucket:

    x0     = the image's VAE posterior mean, 2x2-patchified, BatchNorm-normalised (cached once)
    eps    ~ N(0, I);  sigma ~ --timesteps;  x_t = (1 - sigma) x0 + sigma eps
    pred   = transformer(x_t tokens [+ clean control tokens], caption, timestep sigma)
    loss   = mean over batch, tokens and channels of (pred[:, :L] - (eps - x0))^2, in float32

The transformer rounds sigma to the activation dtype before it scales it by 1000 (as diffusers
does). Edit LoRAs (`controls`): each control image's clean latent tokens follow the target tokens,
with RoPE time coordinate 10, 20, ... as in our editing; only the target tokens carry loss.

Sigma sampling (`timesteps`):
    shift         (default) musubi-tuner's `flux2_shift`: t = sigmoid(N(0, 1)), s = e^mu with mu linear
                  in the image's token count L (0.5 at L = 256, i.e. 256^2 px; 1.15 at L = 4096, 1024^2),
                  sigma = s t / (1 + (s - 1) t). Mid-range noise, shifted toward noise for larger images,
                  as klein's own sampling schedule is; musubi's FLUX.2 guide recommends it. diffusers'
                  uniform default spends as many steps on sigma < 0.1, where the image is nearly clean
                  and the loss says little. (musubi feeds the model sigma + 0.001; we feed sigma.)
    logit-normal  diffusers' `logit_normal`: u = sigmoid(N(0, 1)), sigma = (1000 - floor(1000 u)) / 1000.
    uniform       diffusers' default (`none`): u ~ U(0, 1) on the same grid, sigma uniform on {0.001 .. 1}.

Optimizer: AdamW with torch's semantics (bias correction, decoupled weight decay 1e-4 as diffusers,
eps 1e-8), gradients averaged over `grad_accum` micro-batches and clipped to a global norm of 1.0,
constant learning rate. Data order and adapter init come from a numpy generator seeded with `seed`
(its state is in each checkpoint: resume is bit-exact); each example's noise level and noise come from
(seed, step, example index), so N processes under mlx.launch equal one with N times the batch (distributed.py).
"""

from __future__ import annotations

import math
import platform
import secrets
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from .. import __version__
from ..errors import FluxKleinError
from ..loading import as_dtype, check_weights, describe, load_component
from .adapters import attach_lora, parse_targets, write_lora_file
from ..output import check_output_file, write_exclusive
from ..models.rope import image_ids, text_ids
from ..models.text_encoder import encode_prompts
from ..models.tokenizer import load_tokenizer
from .data import bucket_counts, epoch_batches, load_pixels, scan_data
from .distributed import PeerLost, World, check_processes, example_draws, world
from .evaluation import EMA_FILE, AdapterEMA, Validation, output_writer
from .settings import TrainSettings, differences
from .state import (
    checkpoints, read_checkpoint, read_state, remove_temporaries, write_atomic, write_checkpoint, write_json,
    write_loss_plot,
)  # fmt: skip

TRAIN_TIMESTEPS = 1000  # the scheduler's num_train_timesteps: sigma lives on a grid of 1/1000


# --- events --------------------------------------------------------------------------------------


@dataclass
class TrainStarted:
    total_steps: int
    first_step: int  # the first step this run computes (1, or the checkpoint's step + 1)
    resumed_from: Path | None
    images: int
    buckets: dict  # "WxH" -> images
    adapters: int  # (A, B) pairs
    parameters: int  # trainable values
    work_dir: Path


@dataclass
class StageFinished:
    stage: str  # "captions" | "latents" | "model"
    seconds: float
    detail: str = ""


@dataclass
class StepFinished:
    step: int
    total: int
    loss: float  # mean over the step's micro-batches
    seconds: float
    lr: float
    grad_norm: float  # before clipping
    peak_memory: int  # bytes, this step


@dataclass
class CheckpointSaved:
    step: int
    path: Path


@dataclass
class SamplesSaved:
    step: int
    paths: list[Path]


@dataclass
class TrainFinished:
    output: Path
    steps: int
    seconds: float
    work_dir: Path


# --- the objective -------------------------------------------------------------------------------


def shift_mu(tokens: int) -> float:
    """musubi's flux2_shift mu: linear in the token count, 0.5 at 256 tokens, 1.15 at 4096."""
    m = (1.15 - 0.5) / (4096 - 256)
    return m * tokens + 0.5 - m * 256


def sigmas_from_draws(scheme: str, draws: np.ndarray, tokens: int) -> np.ndarray:
    """sigma (B,) float32 from the run's random numbers: U(0, 1) draws for `uniform`, N(0, 1) for the others."""
    d = np.asarray(draws, dtype=np.float32)
    if scheme == "shift":
        t = (1.0 / (1.0 + np.exp(-d.astype(np.float64)))).astype(np.float32)
        s = math.exp(shift_mu(tokens))
        return ((t * np.float32(s)) / (np.float32(1) + np.float32(s - 1) * t)).astype(np.float32)
    u = d if scheme == "uniform" else (1.0 / (1.0 + np.exp(-d.astype(np.float64)))).astype(np.float32)
    idx = (u * np.float32(TRAIN_TIMESTEPS)).astype(np.int64)  # diffusers: (u * 1000).long()
    # scheduler.sigmas[idx] for klein's config (dynamic shifting: no static shift): (1000 - idx) / 1000
    return (np.float32(TRAIN_TIMESTEPS) - idx.astype(np.float32)) / np.float32(TRAIN_TIMESTEPS)


def flow_loss(model, x0, noise, sigma, ctx, rope, refs=None, checkpoint: bool = False) -> mx.array:
    """The flow-matching loss of one batch, float32.

    x0, noise (B, L, C): clean target tokens and noise; sigma (B,) float32; ctx (B, Lt, E) caption
    embeddings; rope the tables of [text; target; refs]; refs (B, Lr, C) clean control tokens or None.
    """
    dtype = model.dtype
    s = sigma.astype(mx.float32)[:, None, None]
    xt = (1.0 - s) * x0.astype(mx.float32) + s * noise.astype(mx.float32)  # (B, L, C)
    x_in = xt.astype(dtype) if refs is None else mx.concatenate([xt.astype(dtype), refs.astype(dtype)], axis=1)
    t = sigma.astype(dtype)  # the transformer sees sigma rounded to the activation dtype
    pred = model.forward_with_rope(x_in, ctx, t, rope, checkpoint=checkpoint)[:, : x0.shape[1]]
    target = noise.astype(mx.float32) - x0.astype(mx.float32)
    return mx.mean(mx.square(pred.astype(mx.float32) - target))


def make_optimizer(s: TrainSettings) -> optim.AdamW:
    """AdamW as torch.optim.AdamW: MLX's defaults differ (no bias correction, weight decay 0.01; G9)."""
    return optim.AdamW(learning_rate=s.lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=s.weight_decay, bias_correction=True)


def optimizer_step(optimizer: optim.Optimizer, model: nn.Module, grads, max_grad_norm: float) -> mx.array:
    """Clip the gradients to a global norm (torch's `clip_grad_norm_`) and update; returns the norm before clipping."""
    grads, norm = optim.clip_grad_norm(grads, max_grad_norm)
    optimizer.update(model, grads)
    return norm


# --- checks before anything runs -----------------------------------------------------------------


@dataclass
class RunPlan:
    """A checked run: settings, the model as described, the adapters, the data, where to resume."""

    settings: TrainSettings
    info: object  # loading.ModelInfo
    slots: list
    items: list
    resume_from: Path | None
    validation: list = field(default_factory=list)  # held-out TrainItems (--validation)
    world: World = field(default_factory=World)  # the processes of an mlx.launch run


def _check_model(s: TrainSettings):
    info = describe(s.model)
    if info.reference_kv:
        raise FluxKleinError(
            f"{info.name} caches reference keys/values and cannot be trained; train on "
            "black-forest-labs/FLUX.2-klein-base-9B and use the LoRA with the KV model"
        )
    if info.format == "bfl":
        raise FluxKleinError(f"{info.path} is a single weight file; convert it into a model folder first (convert --model ...)")
    stored = next((r for r in info.quantization.values() if r), None)
    if stored and s.quantize is not None and s.quantize != stored["bits"]:
        raise FluxKleinError(f"{info.path} is already quantized to {stored['bits']} bits; leave --quantize out")
    check_weights(info)
    if info.is_distilled:
        size = {"klein-4b": "4B", "klein-9b": "9B"}.get(info.variant, "4B")
        warnings.warn(
            f"{info.name} is a distilled model: training a LoRA on it is not recommended (it breaks the "
            f"distillation); train on the Base model black-forest-labs/FLUX.2-klein-base-{size} instead"
        )
    return info


def run_key(s: TrainSettings, info, processes: int = 1) -> dict:
    """The settings a checkpoint must share with a run that resumes it; the model by its resolved path."""
    return {**s.run_key(), "model": str(info.path), "processes": processes}


def data_key(items) -> list:
    """What a checkpoint records of the data: each example's name, hashes and caption."""
    return [[it.stem, it.image.sha256, it.caption, [c.sha256 for c in it.controls], list(it.bucket)] for it in items]


def _check_resume(s: TrainSettings, info, items, processes: int = 1) -> Path | None:
    """The checkpoint to continue from (None: a new run); refuses mixing runs in one work folder."""
    wd = s.work_dir
    if wd.exists() and not wd.is_dir():
        raise FluxKleinError(f"--work-dir {wd} is a file; give a folder (it is created if missing)")
    if not wd.parent.is_dir():
        raise FluxKleinError(f"--work-dir {wd}: its parent folder {wd.parent} does not exist; create it first")
    done = checkpoints(wd)
    if not s.resume:
        if done:
            raise FluxKleinError(
                f"{wd} holds checkpoints of a run (latest: step {done[-1][0]}); continue it with --resume, "
                "or choose another --work-dir"
            )
        return None
    if not done:
        raise FluxKleinError(f"--resume: no checkpoint in {wd}; run without --resume to start training")
    step, folder = done[-1]
    state = read_state(folder)
    check_processes(folder, state.get("run_key", {}).get("processes", processes), processes)
    diffs = differences(state.get("run_key", {}), run_key(s, info, processes))
    if state.get("data") != data_key(items):
        diffs.append("data: the images, captions or controls differ from the checkpoint's")
    if diffs:
        raise FluxKleinError(
            f"--resume: {folder} is from a run with other settings ({'; '.join(diffs[:3])}); give the same "
            "settings, or start anew in another --work-dir"
        )
    if step > s.steps:
        raise FluxKleinError(f"--resume: {folder} is at step {step}, past --steps {s.steps}; raise --steps")
    return folder


def plan_run(settings: TrainSettings, processes: World | None = None) -> RunPlan:
    """Every check of a run, before any model loads: settings, model files, output, data, work folder."""
    w = processes or world()  # under mlx.launch every process checks its own view, then they agree
    return w.agree(lambda: _plan(settings, w), lambda plan: (plan.settings.run_key(), data_key(plan.items)))


def _plan(settings: TrainSettings, w: World) -> RunPlan:
    s = settings.check()
    if s.output.exists() or s.output.is_symlink():
        raise FluxKleinError(f"--output {s.output} exists and is never overwritten; choose another name")
    check_output_file(s.output)
    info = _check_model(s)
    slots = parse_targets(s.targets, info.params)
    items = scan_data(s.data, s.caption, s.controls, s.resolution)
    held_out = scan_data(s.validation, s.caption, (), s.resolution, option="--validation") if s.validation else []
    resume = _check_resume(s, info, items, w.size) if w.is_main else None  # rank 0 alone has the work folder
    return RunPlan(s, info, slots, items, resume, held_out, w)


def train_lora(model=None, data=None, output=None, **settings) -> Iterator:
    """Train a LoRA; returns a generator of events (`TrainStarted`, `StageFinished`, `StepFinished`,
    `CheckpointSaved`, `SamplesSaved`, `TrainFinished`). The keyword arguments are the fields of
    `TrainSettings`. Every setting, the model files, the output path and every image are checked
    here, before the generator is returned (FluxKleinError, one line); nothing is written until the
    first event is asked for.
    """
    kw = {k: v for k, v in (("model", model), ("data", data), ("output", output)) if v is not None}
    unknown = sorted(set(settings) - set(TrainSettings.__dataclass_fields__))
    if unknown:
        raise FluxKleinError(f"train_lora got unknown setting(s) {', '.join(unknown)}; see TrainSettings")
    plan = plan_run(TrainSettings(**kw, **settings))
    return Trainer(plan).run()


# --- the run -------------------------------------------------------------------------------------


class Trainer:
    """One training run: caches, the model with its adapters, the optimizer, the data order, the RNG."""

    def __init__(self, plan: RunPlan):
        self.plan, self.s, self.info, self.items = plan, plan.settings, plan.info, plan.items
        self.dtype = as_dtype(self.s.dtype)
        self.rng = np.random.default_rng(self.s.seed)
        self.ctx: dict[str, mx.array] = {}  # caption -> (1, Lt, E)
        self.latents: list[mx.array] = []  # per item (1, L, C)
        self.refs: list[mx.array | None] = []  # per item (1, n_controls * L, C) or None
        self.ropes: dict = {}
        self.step_no, self.epoch, self.batches, self.position = 0, 0, [], 0
        self.losses: list[float] = []
        self.sample_pipe = None
        self.world, self.validation = plan.world, Validation(plan.validation)  # validation: empty without --validation
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def run(self) -> Iterator:
        t_run = time.perf_counter()
        s, wd, main = self.s, self.s.work_dir, self.world.is_main
        if main:
            wd.mkdir(exist_ok=True)
            remove_temporaries(wd)
            write_json(wd / "train.json", self.record())
        yield self.cache_captions()
        yield self.cache_latents()
        yield self.load_model()
        try:
            if self.plan.resume_from is not None:
                self.restore(self.plan.resume_from)
            self.apply_state(self.world.share_state(self.state(), self.lora, self.model, self.optimizer))  # from rank 0
            yield TrainStarted(s.steps, self.step_no + 1, self.plan.resume_from, len(self.items), bucket_counts(self.items),
                               len(self.lora.slots), self.lora.num_parameters, wd)  # fmt: skip
            while self.step_no < s.steps:
                yield self.train_step()
                if main and (self.step_no == s.steps or (s.save_every and self.step_no % s.save_every == 0)):
                    if self.validation:  # the held-out loss of these weights, recorded by the checkpoint
                        yield self.validation.measure(self.step_no, partial(flow_loss, self.model), self.ctx, self.rope)
                    yield self.save()
                if main and s.sample_every and self.step_no % s.sample_every == 0:
                    yield self.samples()
        except PeerLost as e:
            raise e.at(self.step_no + 1, checkpoints(wd)) from None
        yield self.finish(time.perf_counter() - t_run)

    # ---- caches (the text encoder and the VAE are released before the first step) ----

    def cache_captions(self) -> StageFinished:
        t0 = time.perf_counter()
        s, info = self.s, self.info
        texts = list(dict.fromkeys([it.caption for it in self.items] + self.validation.captions()))
        extra = list(s.sample_prompts) + ([""] if s.sample_prompts and not info.is_distilled else [])
        texts += [t for t in dict.fromkeys(extra) if t not in texts]
        tokenizer = load_tokenizer(info.tokenizer)
        encoder = load_component(info, "text_encoder", self.dtype, s.quantize, s.group_size)
        for k in range(0, len(texts), 4):  # a few prompts at a time bounds the activations
            chunk = texts[k : k + 4]
            emb = encode_prompts(encoder, tokenizer, chunk).astype(self.dtype)  # (n, 512, E)
            mx.eval(emb)
            if not mx.all(mx.isfinite(emb)).item():
                raise FluxKleinError(f"non-finite prompt embeddings for {chunk[0]!r}: try --dtype float32")
            self.ctx.update({t: emb[i : i + 1] for i, t in enumerate(chunk)})
        del encoder
        mx.clear_cache()
        return StageFinished("captions", time.perf_counter() - t0, f"{len(texts)} texts encoded, text encoder released")

    def cache_latents(self) -> StageFinished:
        t0 = time.perf_counter()
        vae = load_component(self.info, "vae", self.dtype)
        for it in self.items:
            x0 = self._encode(vae, it.image.path, it.bucket)
            refs = None
            if it.controls:  # clean control tokens, one image after another: (1, n * L, C)
                refs = mx.concatenate([self._encode(vae, c.path, it.bucket) for c in it.controls], axis=1)
                mx.eval(refs)
            mx.eval(x0)
            if not mx.all(mx.isfinite(x0)).item():
                raise FluxKleinError(f"non-finite VAE latents for {it.image.path}: try --dtype float32")
            self.latents.append(x0)
            self.refs.append(refs)
        self.validation.encode(lambda path, bucket: self._encode(vae, path, bucket))
        del vae
        mx.clear_cache()
        return StageFinished("latents", time.perf_counter() - t0, f"{len(self.items)} images encoded, VAE released")

    def _encode(self, vae, path: Path, bucket: tuple[int, int]) -> mx.array:
        px = mx.array(load_pixels(path, bucket))[None].astype(self.dtype)  # (1, H, W, 3)
        return vae.encode_to_tokens(px)  # (1, H/16 * W/16, C)

    def load_model(self) -> StageFinished:
        t0 = time.perf_counter()
        s = self.s
        self.model = load_component(self.info, "transformer", self.dtype, s.quantize, s.group_size)
        self.lora = attach_lora(self.model, self.plan.slots, s.rank, s.alpha, self.rng)
        self.optimizer = make_optimizer(s)
        mx.eval(self.model.trainable_parameters())
        self.ema = AdapterEMA(s.ema, self.lora) if s.ema is not None and self.world.is_main else None  # rank 0 writes it

        def loss(weight, x0, noise, sigma, ctx, refs, cos, sin):  # weight: this process's share of the batch
            return flow_loss(self.model, x0, noise, sigma, ctx, (cos, sin), refs, checkpoint=s.low_memory) * weight

        self.loss_and_grad = nn.value_and_grad(self.model, loss)
        q = f", {s.quantize}-bit base" if s.quantize else ""
        return StageFinished("model", time.perf_counter() - t0, f"{len(self.lora.slots)} adapters of rank {s.rank}{q}")

    # ---- one optimizer step -------------------------------------------------------------------

    def next_batch(self) -> list[int]:
        if self.position >= len(self.batches):  # global batches: every process draws the same order
            self.batches = epoch_batches(self.items, self.s.batch_size * self.world.size, self.rng)
            self.epoch, self.position = self.epoch + 1, 0
        self.position += 1
        return self.batches[self.position - 1]

    def rope(self, it, n_refs: int):
        key = (it.bucket, n_refs)
        if key not in self.ropes:
            W, H = it.bucket
            ids = [image_ids(H // 16, W // 16)] + [image_ids(H // 16, W // 16, t=10 * (k + 1)) for k in range(n_refs)]
            self.ropes[key] = self.model.compute_rope(text_ids(512), mx.concatenate(ids, axis=0))
        return self.ropes[key]

    def micro_batch(self, indices: list[int], first: int) -> tuple:
        """(x0, noise, sigma, ctx, refs, cos, sin) of one batch; example j's draws keyed (seed, step, first + j)."""
        x0 = mx.concatenate([self.latents[i] for i in indices], axis=0)  # (B, L, C)
        B, L, C = x0.shape
        draws, noise = example_draws(self.s.seed, self.step_no + 1, range(first, first + B), self.s.timesteps, (L, C))
        sigma, noise = mx.array(sigmas_from_draws(self.s.timesteps, draws, L)), mx.array(noise)
        ctx = mx.concatenate([self.ctx[self.items[i].caption] for i in indices], axis=0)
        refs = None if self.refs[indices[0]] is None else mx.concatenate([self.refs[i] for i in indices], axis=0)
        cos, sin = self.rope(self.items[indices[0]], len(self.items[indices[0]].controls))
        return x0, noise, sigma, ctx, refs, cos, sin

    def train_step(self) -> StepFinished:
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        s, total, grads = self.s, 0.0, None
        for k in range(s.grad_accum):
            batch = self.next_batch()
            part = self.world.share(len(batch))
            if len(part):
                first = k * s.batch_size * self.world.size + part.start  # counted over the step's global batches
                args = self.micro_batch([batch[i] for i in part], first)
                loss, g = self.loss_and_grad(len(part) / len(batch), *args)
            else:  # a bucket's last global batch can leave a process without examples
                loss, g = mx.array(0.0), tree_map(mx.zeros_like, self.model.trainable_parameters())
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(loss, grads)
            total += loss.item()
        grads, total = self.world.sum_grads(grads, total)  # several processes: the sum of their shares
        if s.grad_accum > 1:
            grads = tree_map(lambda g: g / s.grad_accum, grads)
        norm = optimizer_step(self.optimizer, self.model, grads, s.max_grad_norm)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state, norm)
        self.step_no += 1
        loss = total / s.grad_accum
        if not math.isfinite(loss) or not math.isfinite(norm.item()):
            raise FluxKleinError(
                f"the loss became non-finite at step {self.step_no}; lower --lr, or train with --dtype float32"
            )
        self.losses.append(loss)
        if self.ema is not None:
            self.ema.update(self.lora, self.step_no)
        return StepFinished(self.step_no, s.steps, loss, time.perf_counter() - t0, s.lr, norm.item(), mx.get_peak_memory())

    # ---- checkpoints, samples, the end ----------------------------------------------------------

    def state(self) -> dict:
        return {
            "step": self.step_no, "epoch": self.epoch, "batches": self.batches, "position": self.position,
            "rng": self.rng.bit_generator.state, "losses": self.losses, "run_key": run_key(self.s, self.info, self.world.size),
            "data": data_key(self.items), "flux_klein_mlx": __version__, "validation": self.validation.history,
        }  # fmt: skip

    def save(self) -> CheckpointSaved:
        lora = (self.lora.file_arrays(mx.float32), self.lora.metadata())
        opt = dict(tree_flatten(self.optimizer.state))
        extra = {EMA_FILE: (self.ema.file_arrays(mx.float32), self.lora.metadata())} if self.ema else {}
        path = write_checkpoint(self.s.work_dir, self.step_no, lora, opt, self.state(), self.s.keep_checkpoints, extra)
        write_loss_plot(self.s.work_dir / "loss.png", self.losses, self.validation.points())
        return CheckpointSaved(self.step_no, path)

    def restore(self, folder: Path) -> None:
        """Continue exactly where `folder` left off: adapters, AdamW moments, data order, RNG."""
        lora, opt, state = read_checkpoint(folder)
        self.lora.load(lora, f"checkpoint {folder}")
        self.optimizer.init(self.model.trainable_parameters())
        if set(opt) != {k for k, _ in tree_flatten(self.optimizer.state)}:
            raise FluxKleinError(f"checkpoint {folder} holds another run's optimizer state; start anew in another --work-dir")
        self.optimizer.state = tree_map_with_path(lambda path, _: opt[path], self.optimizer.state)
        self.apply_state(state)
        if self.ema is not None:
            self.ema.load(folder)

    def apply_state(self, state: dict) -> None:
        """The data position, RNG and histories of a checkpoint's (or rank 0's) state."""
        self.rng.bit_generator.state = state["rng"]
        self.step_no, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.batches, self.losses = state["batches"], list(state["losses"])
        self.validation.history = list(state.get("validation", []))
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)

    def samples(self) -> SamplesSaved:
        """Images from the sample prompts with the current LoRA, through the public pipeline (which
        loads its own, low-memory copy of the model; the training model stays as it is)."""
        from ..pipeline import load

        s, wd = self.s, self.s.work_dir
        lora_file = wd / f".sample-lora.{secrets.token_hex(4)}.tmp"
        write_lora_file(lora_file, self.lora, self.dtype)
        try:
            if self.sample_pipe is None:
                self.sample_pipe = load(s.model, dtype=s.dtype, quantize=s.quantize, group_size=s.group_size,
                                        low_memory=True, loras=[lora_file])  # fmt: skip
                for text, emb in self.ctx.items():
                    if text in s.sample_prompts or text == "":
                        self.sample_pipe.remember_prompt(text, emb)
            else:
                self.sample_pipe.set_loras([lora_file])
            (wd / "samples").mkdir(exist_ok=True)
            size = max(64, 16 * round(s.resolution / 16))
            paths = []
            for k, prompt in enumerate(s.sample_prompts):
                image = self.sample_pipe.generate(prompt, width=size, height=size, steps=s.sample_steps, seed=s.sample_seed)
                path = wd / "samples" / f"step-{self.step_no:06d}-{k}.png"
                write_atomic(path, lambda tmp: image.save(tmp, format="PNG"))
                paths.append(path)
        finally:
            lora_file.unlink(missing_ok=True)
        return SamplesSaved(self.step_no, paths)

    def record(self, **extra) -> dict:
        """train.json: every setting, the data with hashes, the adapters, versions."""
        return {
            "flux_klein_mlx": __version__, "mlx": mx.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "model": {"source": str(self.s.model), "name": self.info.name,
                                                       "path": str(self.info.path)},
            "settings": self.s.record(), "data": [it.record() for it in self.items], "buckets": bucket_counts(self.items),
            "targets": [sl.name for sl in self.plan.slots], "resumed_from": str(self.plan.resume_from or "") or None,
            "started": self.started, "processes": self.world.size,
            "validation": self.validation.history or None, **extra,
        }  # fmt: skip

    def finish(self, seconds: float) -> TrainFinished:
        s = self.s
        if not self.world.is_main:  # rank 0 writes the output
            return TrainFinished(s.output, self.step_no, seconds, s.work_dir)
        final = write_exclusive(s.output, output_writer(self.ema, self.lora, self.dtype))
        finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
        write_json(s.work_dir / "train.json", self.record(output=str(final), finished=finished, steps=self.step_no,
                                                          final_loss=self.losses[-1] if self.losses else None))  # fmt: skip
        if self.losses:
            write_loss_plot(s.work_dir / "loss.png", self.losses, self.validation.points())
        return TrainFinished(final, self.step_no, seconds, s.work_dir)
