"""LoRA training on klein Base (FLUX.2 [klein], FLUX 3 Image Klein): the run, step by step (objective.py).

    for event in flux_klein_mlx.train_lora(model="black-forest-labs/FLUX.2-klein-base-4B",
                                           data="photos/", output="ink.safetensors", steps=500):
        print(event)

`train_lora` checks everything a run needs before any model loads (`plan_run`: the settings, the model
files, the output, the data, the work folder and its checkpoints, the memory plan), then the `Trainer`
caches the captions (text encoder, then released) and the latents (VAE, then released), loads the
transformer with its adapters and runs the steps, yielding typed events. Data order and adapter init
come from a numpy generator seeded with `seed` (its state is in each checkpoint: resume is bit-exact);
each example's noise level and noise come from (seed, step, example index), so N processes under
mlx.launch equal one with N times the batch (distributed.py).
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from .. import __version__
from ..dtypes import as_dtype
from ..errors import FluxKleinError
from ..models.rope import token_grid
from ..run.components import load_component
from .data.captions import CaptionEmbeddings
from .data.dataset import bucket_counts, dropped_captions, epoch_batches, flipped_examples
from .plan import RunPlan, data_key, epochs_ended, plan_run, run_key
from .report.evaluation import EMA_FILE, AdapterEMA, Validation, average_window, moving_average, write_loss_plot
from .report.events import CheckpointSaved, StageFinished, StageStarted, StepFinished, TrainFinished, TrainStarted
from .report.metrics import MetricsLog
from .report.samples import SampleImages, SamplesSaved
from .settings import TrainSettings
from .state import adapter_file, read_checkpoint, write_checkpoint, write_json, write_output
from .step.adapters import attach_lokr, attach_lora, file_header, write_lora_file
from .step.distributed import PeerLost, example_draws
from .step.objective import batch_loss, flow_loss, lr_at_step, optimizer_step, sigmas_from_draws
from .step.optimizers import make_optimizer
from .workdir import acquire_lock, check_work_dir, checkpoints, claim_work_dir, remove_temporaries


def train_lora(model=None, data=None, output=None, **settings) -> Iterator:
    """Train a LoRA; returns a generator of events (`MemoryPlanned`, `TrainStarted`, `StageFinished`,
    `StepFinished`, `CheckpointSaved`, `SamplesSaved`, `TrainFinished`). The keyword arguments are the fields of
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
        self.plan = plan
        self.settings = plan.settings
        self.info = plan.info
        self.items = plan.items
        self.dtype = as_dtype(self.settings.dtype)
        self.rng = np.random.default_rng(self.settings.seed)
        self.ctx: dict[str, mx.array] = {}  # caption -> (1, Lt, E)
        self.latents: list[mx.array] = []  # per item (1, L, C)
        self.refs: list[mx.array | None] = []  # per item (1, n_controls * L, C) or None
        self.mirrored: list[tuple] = []  # --flip: per item (x0, refs) mirrored left to right
        self.metrics: MetricsLog | None = None  # rank 0's metrics.jsonl, once the run's first step is known
        self.latent_cache = plan.latents  # the latents the run needs (train/data/latents.py)
        self.ropes: dict = {}
        self.step_no = 0
        self.epoch = 0
        self.batches = []
        self.position = 0
        self.losses: list[float] = []
        # samples are rank 0's, as every file: the other ranks of an mlx.launch run load no sample model
        drawn_here = plan.sample_info is not None and plan.world.is_main
        self.sample_images = (
            SampleImages(self.settings, plan.sample_info, plan.sample_references) if drawn_here else None
        )
        self.trained_peak = 0  # the highest training-step memory peak so far (bytes)
        self.world = plan.world
        self.validation = Validation(plan.validation)  # validation: empty without --validation
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.started_at = time.time()  # unix time, for the LoRA file's header

    def run(self) -> Iterator:
        wd = self.settings.work_dir
        if not self.world.is_main:  # rank 0 alone has the work folder
            yield from self._run(time.perf_counter())
            return
        check_work_dir(
            wd, self.settings.data, self.settings.controls
        )  # again: the folder may have changed since the plan
        claim_work_dir(wd)
        lock = acquire_lock(wd)  # a second run on this folder refuses here, before any model loads
        try:
            yield from self._run(time.perf_counter())
        finally:  # also on Ctrl-C or an error: the folder is free again
            lock.release()
            if self.metrics is not None:
                self.metrics.close()

    def _run(self, t_run: float) -> Iterator:
        settings = self.settings
        wd = self.settings.work_dir
        main = self.world.is_main
        if main:
            remove_temporaries(wd)
            write_json(wd / "train.json", self.record())
            if self.plan.memory is not None:
                yield self.plan.memory  # before any model loads
        yield self.caption_plan()
        yield self.text.encode(load_component)  # this module's: tests count the loads
        if self.sample_images is not None:  # its text encoder runs while no training model is resident
            seconds, detail = self.sample_images.load()
            yield StageFinished(stage="sample model", seconds=seconds, detail=detail)
        yield self.latent_plan()
        yield self.cache_latents()
        yield StageStarted(
            stage="model",
            detail=f"loading the transformer{f' ({settings.quantize}-bit)' if settings.quantize else ''} ...",
        )
        yield self.load_model()
        try:
            if self.plan.resume_from is not None:
                self.restore(self.plan.resume_from)
            self.apply_state(self.world.share_state(self.state(), self.lora, self.model, self.optimizer))  # from rank 0
            if self.sample_images is not None:
                # no LoRA: what each sample is compared with (a resume keeps the first start's)
                yield self.sample_images.baseline(resumed=self.plan.resume_from is not None)
            if main:  # metrics.jsonl (and TensorBoard's events), continued after the checkpoint resumed
                self.metrics = MetricsLog(wd, resumed_at=self.step_no)
            yield self.started_event()
            while self.step_no < settings.steps:
                yield self.logged(self.train_step())
                if main and (
                    self.step_no == settings.steps
                    or (settings.save_every and self.step_no % settings.save_every == 0)
                    or self.ends_epoch(settings.save_every_epochs)
                ):
                    if self.validation:  # the held-out loss of these weights, recorded by the checkpoint
                        yield self.logged(
                            self.validation.measure(self.step_no, partial(flow_loss, self.model), self.ctx, self.rope)
                        )
                    yield self.save()
                if main and (
                    (settings.sample_every and self.step_no % settings.sample_every == 0)
                    or self.ends_epoch(settings.sample_every_epochs)
                ):
                    yield self.samples()
        except PeerLost as e:
            raise e.at(self.step_no + 1, checkpoints(wd)) from None
        yield self.finish(time.perf_counter() - t_run)

    # ---- caches (the text encoder and the VAE are released before the first step) ----

    def started_event(self) -> TrainStarted:
        settings = self.settings
        images = len({it.stem for it in self.items})  # several resolutions: one item per image and size
        layers = len({sl.layer for sl in self.lora.slots})
        return TrainStarted(
            total_steps=settings.steps,
            first_step=self.step_no + 1,
            resumed_from=self.plan.resume_from,
            images=images,
            buckets=bucket_counts(self.items),
            adapters=self.lora.count,
            parameters=self.lora.num_parameters,
            work_dir=settings.work_dir,
            layers=layers,
            processes=self.world.size,
            batch_size=settings.batch_size,
            caption=self.items[0].caption,
        )

    def caption_plan(self) -> StageStarted:
        """The run's texts (captions, held-out captions, the dropout's empty caption; train/data/captions.py):
        those in the prompt cache are read now; says what is left."""
        captions = [it.caption for it in self.items] + self.validation.captions()
        self.text = CaptionEmbeddings(self.settings, self.info, self.dtype, captions)
        self.ctx = self.text.ctx
        return self.text.plan()

    def latent_plan(self) -> StageStarted:
        """The latents of every example (and its controls) and held-out image: those in the latent cache are
        read now (train/data/latents.py); says what is left."""
        images = len({it.image.sha256 for it in self.items})
        controls = len({(c.sha256, it.bucket) for it in self.items for c in it.controls})
        return self.latent_cache.plan(images, controls)

    def cache_latents(self) -> StageFinished:
        done = self.latent_cache.encode(load_component)  # this module's: tests count the loads
        get = self.latent_cache.get
        for it in self.items:
            self.latents.append(get(it.image, it.bucket))
            self.refs.append(self.control_tokens(it, flip=False))
        if self.settings.flip:  # (--flip) the mirrored example, its controls mirrored with it
            self.mirrored = [(get(it.image, it.bucket, True), self.control_tokens(it, flip=True)) for it in self.items]
        self.validation.encode(get)  # (picture, bucket) -> tokens
        return done

    def control_tokens(self, it, flip: bool) -> mx.array | None:
        """An example's clean control tokens, one image after another: (1, n * L, C), or None."""
        if not it.controls:
            return None
        return mx.concatenate([self.latent_cache.get(c, it.bucket, flip) for c in it.controls], axis=1)

    def load_model(self) -> StageFinished:
        t0 = time.perf_counter()
        settings = self.settings
        self.model = load_component(
            self.info, "transformer", self.dtype, quantize=settings.quantize, group_size=settings.group_size
        )
        if settings.adapter == "lokr":
            params = self.plan.info.params
            self.lora = attach_lokr(
                self.model,
                self.plan.slots,
                params=params,
                rank=settings.rank,
                alpha=settings.alpha,
                factor=settings.lokr_factor,
                rng=self.rng,
            )
        else:
            self.lora = attach_lora(self.model, self.plan.slots, rank=settings.rank, alpha=settings.alpha, rng=self.rng)
            if self.plan.init_arrays:  # --init-lora: the file's pairs where it has them (a resume's checkpoint wins)
                self.lora.load({**self.lora.arrays(), **self.plan.init_arrays}, f"--init-lora {settings.init_lora}")
        self.optimizer = make_optimizer(settings)
        mx.eval(self.model.trainable_parameters())
        self.ema = (
            AdapterEMA(settings.ema, self.lora) if settings.ema is not None and self.world.is_main else None
        )  # rank 0 writes it

        def loss(weight, x0, noise, sigma, ctx, refs, rope):  # weight: this process's share of the batch
            low = settings.low_memory
            return (
                batch_loss(self.model, x0, noise, sigma=sigma, ctx=ctx, rope=rope, refs=refs, checkpoint=low) * weight
            )

        self.loss_and_grad = nn.value_and_grad(self.model, loss)
        q = f", {settings.quantize}-bit base" if settings.quantize else ""
        return StageFinished(
            stage="model",
            seconds=time.perf_counter() - t0,
            detail=f"{self.lora.count} {settings.adapter} adapters of rank {settings.rank}{q}",
        )

    # ---- one optimizer step -------------------------------------------------------------------

    def next_batch(self) -> list[int]:
        if self.position >= len(self.batches):  # global batches: every process draws the same order
            self.batches = epoch_batches(self.items, self.settings.batch_size * self.world.size, self.rng)
            self.epoch = self.epoch + 1
            self.position = 0
        self.position += 1
        return self.batches[self.position - 1]

    def rope(self, it, n_refs: int, text_tokens: int):
        """The tables of item `it`'s size with `n_refs` references and `text_tokens` text tokens (the family's)."""
        key = (it.bucket, n_refs, text_tokens)
        if key not in self.ropes:
            grid = token_grid(*it.bucket)
            self.ropes[key] = self.info.family.training_rope(self.model, grid, n_refs, text_tokens)
        return self.ropes[key]

    def micro_batch(self, indices: list[int], first: int) -> tuple:
        """(x0, noise, sigma, ctx, refs, rope) of one batch: ctx one (1, Lt, E) per example, rope(Lt) its tables;
        example j's draws keyed (seed, step, first + j)."""
        flips = [False] * len(indices)
        if self.settings.flip:  # which examples train mirrored (data.flipped_examples)
            flips = flipped_examples(self.settings.seed, self.step_no + 1, range(first, first + len(indices)))
        pairs = [
            self.mirrored[i] if f else (self.latents[i], self.refs[i]) for i, f in zip(indices, flips, strict=True)
        ]
        x0 = mx.concatenate([x for x, _ in pairs], axis=0)  # (B, L, C)
        B, L, C = x0.shape
        draws, noise = example_draws(
            self.settings.seed,
            self.step_no + 1,
            indices=range(first, first + B),
            scheme=self.settings.timesteps,
            shape=(L, C),
        )
        sigma = mx.array(sigmas_from_draws(self.settings.timesteps, draws, L, self.info.family.train_shift))
        noise = mx.array(noise)
        dropped = dropped_captions(
            self.settings.seed, self.epoch, position=self.position, n=len(indices), p=self.settings.caption_dropout
        )
        captions = ["" if drop else self.items[i].caption for i, drop in zip(indices, dropped, strict=True)]
        refs = None if pairs[0][1] is None else mx.concatenate([r for _, r in pairs], axis=0)
        it = self.items[indices[0]]
        return x0, noise, sigma, [self.ctx[c] for c in captions], refs, partial(self.rope, it, len(it.controls))

    def train_step(self) -> StepFinished:
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        settings = self.settings
        total = 0.0
        grads = None
        for k in range(settings.grad_accum):
            batch = self.next_batch()
            part = self.world.share(len(batch))
            if len(part):
                first = k * settings.batch_size * self.world.size + part.start  # counted over the step's global batches
                args = self.micro_batch([batch[i] for i in part], first)
                loss, g = self.loss_and_grad(len(part) / len(batch), *args)
            else:  # a bucket's last global batch can leave a process without examples
                loss = mx.array(0.0)
                g = tree_map(mx.zeros_like, self.model.trainable_parameters())
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(loss, grads)
            total += loss.item()
        grads, total = self.world.sum_grads(grads, total)  # several processes: the sum of their shares
        if settings.grad_accum > 1:
            grads = tree_map(lambda g: g / settings.grad_accum, grads)
        lr = self.lr_of(self.step_no + 1)
        self.optimizer.learning_rate = lr  # the schedule's value for this step (train/step/objective.py)
        norm = optimizer_step(self.optimizer, self.model, grads, settings.max_grad_norm)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state, norm)
        self.step_no += 1
        loss = total / settings.grad_accum
        if not math.isfinite(loss) or not math.isfinite(norm.item()):
            raise FluxKleinError(
                f"the loss became non-finite at step {self.step_no}; lower --lr, or train with --dtype float32"
            )
        self.losses.append(loss)
        self.trained_peak = max(self.trained_peak, mx.get_peak_memory())
        if self.ema is not None:
            self.ema.update(self.lora, self.step_no)
        window = average_window(settings.steps)
        average = moving_average(self.losses[-window:], window)[-1]  # the plot's number for this step
        peak = mx.get_peak_memory()
        return StepFinished(
            step=self.step_no,
            total=settings.steps,
            loss=loss,
            seconds=time.perf_counter() - t0,
            lr=lr,
            grad_norm=norm.item(),
            peak_memory=peak,
            average=average,
        )

    def logged(self, ev):
        """`ev` (a step or a validation), its numbers written to metrics.jsonl first (train/report/metrics.py)."""
        if self.metrics is None:
            return ev
        if isinstance(ev, StepFinished):
            values = {"loss": ev.loss, "average": ev.average, "lr": ev.lr, "grad_norm": ev.grad_norm}
            values |= {"seconds": ev.seconds, "peak_memory": ev.peak_memory, "epoch": self.epoch}
            self.metrics.write(ev.step, values)
        else:
            values = {"validation_loss": ev.loss, "validation_by_sigma": ev.by_sigma}
            self.metrics.write(ev.step, values, group="validation")
        return ev

    def ends_epoch(self, every: int | None) -> bool:
        """Whether the step just done ran the last batch of an epoch whose number is a multiple of `every`
        (--save-every-epochs, --sample-every-epochs; plan.epochs_ended)."""
        if not every:
            return False
        ended = epochs_ended(self.step_no, batches=self.plan.batches_per_epoch, grad_accum=self.settings.grad_accum)
        return any(e % every == 0 for e in ended)

    def lr_of(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based) under --lr-scheduler / --warmup-steps."""
        settings = self.settings
        return lr_at_step(
            settings.lr_scheduler, base_lr=settings.lr, step=step, warmup=settings.warmup_steps, total=settings.steps
        )

    def lrs(self) -> list[float]:
        """The learning rate of every step done (for loss.png)."""
        return [self.lr_of(k) for k in range(1, len(self.losses) + 1)]

    # ---- checkpoints, samples, the end ----------------------------------------------------------

    def state(self) -> dict:
        return {
            "step": self.step_no,
            "epoch": self.epoch,
            "batches": self.batches,
            "position": self.position,
            "rng": self.rng.bit_generator.state,
            "losses": self.losses,
            "run_key": run_key(self.settings, self.info, self.world.size),
            "data": data_key(self.items),
            "flux_klein_mlx": __version__,
            "validation": self.validation.history,
        }

    def save(self) -> CheckpointSaved:
        lora = adapter_file(self.lora)
        opt = dict(tree_flatten(self.optimizer.state))
        extra = {}
        if self.ema is not None:  # the average as a file of the same layout: it loads where lora.safetensors does
            with self.ema.in_adapters(self.lora):
                extra[EMA_FILE] = adapter_file(self.lora)
        path = write_checkpoint(
            self.settings.work_dir,
            self.step_no,
            lora=lora,
            optimizer=opt,
            state=self.state(),
            keep=self.settings.keep_checkpoints,
            extra=extra,
        )
        self.plot_loss()
        return CheckpointSaved(step=self.step_no, path=path)

    def plot_loss(self) -> None:
        """loss.png: every step's loss since step 1 (a resume continues the list), the lr beside it."""
        path = self.settings.work_dir / "loss.png"
        window = average_window(self.settings.steps)
        write_loss_plot(path, self.losses, window=window, lrs=self.lrs(), validation=self.validation.points())

    def restore(self, folder: Path) -> None:
        """Continue exactly where `folder` left off: adapters, the optimizer's state, data order, RNG."""
        terms, opt, state = read_checkpoint(folder, self.lora)
        self.lora.load_terms(terms, f"checkpoint {folder}")
        self.optimizer.init(self.model.trainable_parameters())
        if set(opt) != {k for k, _ in tree_flatten(self.optimizer.state)}:
            raise FluxKleinError(
                f"checkpoint {folder} holds another run's optimizer state; start anew in another --work-dir"
            )
        self.optimizer.state = tree_map_with_path(lambda path, _: opt[path], self.optimizer.state)
        self.apply_state(state)
        if self.ema is not None:
            self.ema.load(folder, self.lora)

    def apply_state(self, state: dict) -> None:
        """The data position, RNG and histories of a checkpoint's (or rank 0's) state."""
        self.rng.bit_generator.state = state["rng"]
        self.step_no = state["step"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.batches = state["batches"]
        self.losses = list(state["losses"])
        self.validation.history = list(state.get("validation", []))
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)

    def samples(self) -> SamplesSaved:
        """Each sample prompt with the LoRA as it is now, as the output would be written (the EMA under --ema),
        on the sample model (train/report/samples.py)."""
        header = file_header(self.settings, self.info, items=self.items, steps=self.step_no, started_at=self.started_at)
        with self.ema.in_adapters(self.lora) if self.ema else nullcontext():
            return self.sample_images.sample(self.step_no, self.lora, self.trained_peak, header)

    def record(self, **extra) -> dict:
        """train.json: every setting, the data with hashes, the adapters, versions."""
        return {
            "flux_klein_mlx": __version__,
            "mlx": mx.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "model": {"source": str(self.settings.model), "name": self.info.name, "path": str(self.info.path)},
            "settings": self.settings.record(),
            "data": [it.record() for it in self.items],
            "buckets": bucket_counts(self.items),
            "targets": [sl.name for sl in self.plan.slots],
            "resumed_from": str(self.plan.resume_from or "") or None,
            "started": self.started,
            "processes": self.world.size,
            "validation": self.validation.history or None,
            **extra,
        }

    def finish(self, seconds: float) -> TrainFinished:
        settings = self.settings
        if not self.world.is_main:  # rank 0 writes the output
            return TrainFinished(
                output=settings.output, steps=self.step_no, seconds=seconds, work_dir=settings.work_dir
            )
        header = file_header(settings, self.info, items=self.items, steps=self.step_no, started_at=self.started_at)

        def write(tmp: Path) -> None:
            write_lora_file(
                tmp,
                self.lora,
                dtype=as_dtype(settings.save_dtype),
                layout=settings.format,
                params=self.info.params,
                header=header,
            )

        final = write_output(
            settings.output, self.ema.writing(self.lora, write) if self.ema else write, settings.work_dir
        )
        finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
        write_json(
            settings.work_dir / "train.json",
            self.record(
                output=str(final),
                finished=finished,
                steps=self.step_no,
                final_loss=self.losses[-1] if self.losses else None,
            ),
        )
        if self.losses:
            self.plot_loss()
        return TrainFinished(output=final, steps=self.step_no, seconds=seconds, work_dir=settings.work_dir)
