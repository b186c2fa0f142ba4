"""What a training run reports as it goes (`train_lora` yields them; `train` prints them): typed events, built
by keyword. The plan's `MemoryPlanned`, the samples' `SamplesSaved` and validation's `ValidationFinished` live
beside what makes them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True)
class TrainStarted:
    total_steps: int
    first_step: int  # the first step this run computes (1, or the checkpoint's step + 1)
    resumed_from: Path | None
    images: int
    buckets: dict  # "WxH" -> images
    adapters: int  # (A, B) pairs: q, k and v of a fused layer are three, as `generate` counts a LoRA's
    parameters: int  # trainable parameters
    work_dir: Path
    layers: int = 0  # the model's layers they sit on
    processes: int = 1  # the processes of an mlx.launch run, each training its share of every batch
    batch_size: int = 1  # --batch-size: each process's share of a global batch of processes x batch_size
    caption: str = ""  # the first example's caption as it trains (--trigger applied)


@dataclass(kw_only=True)
class StageStarted:
    stage: str  # "captions" | "latents" | "model", before the work: what is about to happen
    detail: str


@dataclass(kw_only=True)
class StageFinished:
    stage: str  # "captions" | "sample model" | "latents" | "model"
    seconds: float
    detail: str = ""


@dataclass(kw_only=True)
class StepFinished:
    step: int
    total: int
    loss: float  # mean over the step's micro-batches
    seconds: float
    lr: float
    grad_norm: float  # before clipping
    peak_memory: int  # bytes, this step
    average: float = math.nan  # the trailing mean the loss plot draws (evaluation.average_window steps)


@dataclass(kw_only=True)
class CheckpointSaved:
    step: int
    path: Path


@dataclass(kw_only=True)
class TrainFinished:
    output: Path
    steps: int
    seconds: float
    work_dir: Path


def plural(n: int, word: str) -> str:
    """ "1 image", "2 images": the counts the stages' lines say."""
    return f"{n} {word}{'' if n == 1 else 's'}"
