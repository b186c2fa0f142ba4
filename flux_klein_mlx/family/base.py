"""The contract of a model family (family/__init__.py says who asks it what)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ..events import Job


@dataclass(frozen=True)
class Target:
    """Where a named module lands in our model: a layer, a row range of its output, and the row order."""

    layer: str  # our module path, e.g. "double_blocks.0.img_attn.qkv"
    rows: tuple[int, int]  # [start, stop) of the layer's output rows
    swap: bool = False  # rows given as [scale ; shift] (diffusers' norm_out), ours are [shift ; scale]


@dataclass(frozen=True)
class LoraNames:
    """What lora/ asks of one model family (`Family.lora`): its transformer's names and shapes, and the markers that
    tell its files (a LoRA file has no header that names its model; a model file's is its keys)."""

    title: str  # family/'s Family.title
    params_type: type  # the transformer's hyper-parameters
    table: Callable  # params -> {module name a LoRA may use: Target}
    modules: Callable  # (params, blocks_only) -> diffusers' Linear module names, in model order
    shapes: Callable  # params -> {our layer: (out, in)}
    markers: re.Pattern  # module names (dotted or underscored, any prefix) only this family has: its files' one list
    hidden_sizes: dict[int, str]  # the released models by hidden size, for "made for ..." messages
    guess: (
        Callable  # (keys, {module: input width}) -> the transformers a LoRA file's shapes may be for, likeliest first
    )
    fused: dict = field(default_factory=dict)  # diffusers' fused projections (their name: our layer)
    check: Callable | None = None  # (names, params, what) -> None: a family's own refusal


SINGLE_BLOCK = re.compile(r"(?:single_blocks|single_transformer_blocks)[._](\d+)[._]")  # N of a single block
EDGE = r"(?:^|(?<=[._]))"  # a name segment starts here (after a prefix, a dot or kohya's underscore)


class Steps(Protocol):
    """One image's denoising calls, built once per image by `Family.steps`."""

    def velocity(self, x: mx.array, i: int) -> mx.array:
        """The guided velocity (1, h*w, C) of the target tokens `x` (1, h*w, C) at step `i` of `job.sigmas`."""
        ...


class Family(Protocol):
    key: str  # "flux2" | "flux3": what a converted folder and a record name
    title: str  # "FLUX.2 [klein]" | "FLUX 3 Image Klein"
    params_type: type  # the transformer's hyper-parameter dataclass
    text_taps: tuple[int, ...]  # the text encoder's decoder layers (1-based) whose states are stacked per token
    text_window: object  # models/tokenizer.TextWindow: how a prompt fills the window the transformer reads
    text_key: dict  # what the prompt cache's key adds for this family's embeddings
    index_files: tuple[str, ...]  # a diffusers snapshot's index file names, in the order tried
    pipeline_classes: tuple[str, ...]  # the index's `_class_name`s of this family's pipelines
    class_prefix: str  # diffusers' class names of its pipelines and transformer start with it
    lora: LoraNames  # its LoRA files' names, shapes and markers (lora/ asks it)
    upsampler: str | None  # the hub repo of BFL's prompt upsampler for this family (None: it has none)
    variants: dict  # its released models' rows (models/config.Variant), by name: the benchmark's random models
    # training (train/, docs/training.md): the family's pieces of the objective and of --targets
    trains_distilled: bool  # False: `train` refuses the distilled model (True: it warns and names the Base)
    train_shift: float | None  # the constant shift of `--timesteps shift` (None: FLUX.2's, by the image's tokens)
    target_groups: dict[str, tuple[str, str]]  # --targets block presets: name -> (diffusers prefix, params field)
    reference_group: str | None  # the preset only reference tokens run through (left out of `all` without controls)
    planned_text_tokens: int  # the text tokens the memory plan counts per example (before any caption is encoded)

    def is_distilled(self, index: dict, transformer_config: dict) -> bool:
        """Whether a snapshot is the distilled model, from its index and transformer config."""
        ...

    def reference_kv(self, index: dict) -> bool:
        """Whether a snapshot's model caches the references' K/V (klein 9B-KV), from its index."""
        ...

    def model_title(self, params, distilled: bool, reference_kv: bool) -> str:
        """The model's name in messages and records, e.g. "FLUX.2 [klein] 4B Base"."""
        ...

    def encode_prompts(self, encoder: nn.Module, tokenizer, prompts: list[str]) -> list[mx.array]:
        """One (1, L, C) embedding per prompt, lazy (the window rule decides L)."""
        ...

    def prepare_references(self, images: list, model_name: str) -> tuple[list, tuple | None]:
        """Reference pixels (each (H, W, 3) float32 in [-1, 1]) and the box to crop the output back to (or None)."""
        ...

    def params(self, config: dict):
        """The transformer's hyper-parameters from a diffusers config.json (or our own field names)."""
        ...

    def build_transformer(self, params) -> nn.Module:
        """An unloaded (lazily initialised) transformer."""
        ...

    def sanitize_transformer(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A transformer checkpoint (diffusers, BFL or ours) under our module names; foreign models refused."""
        ...

    def infer_params(self, weights: dict[str, mx.array]):
        """The hyper-parameters implied by sanitized weights' shapes (a BFL single file has no config)."""
        ...

    def linear_shapes(self, params) -> dict[str, tuple[int, int]]:
        """(out, in) of every Linear of the transformer, by module path (the LoRA tables' shapes)."""
        ...

    def defaults(self, distilled: bool) -> tuple[int, float | None]:
        """(steps, guidance) of a distilled or Base model (guidance None: no CFG)."""
        ...

    def sigmas(self, image_tokens: int, steps: int) -> list[float]:
        """The steps + 1 sigmas from 1 to 0 for an image of `image_tokens` target tokens."""
        ...

    def reference_ids(self, k: int, h: int, w: int) -> mx.array:
        """RoPE ids (h*w, 4) of reference image `k` (0-based) on an h x w token grid."""
        ...

    def distilled_repo(self, model: str) -> str | None:
        """The distilled model's repo id for a published Base repo id (samples run there), else None."""
        ...

    def size_key(self, params) -> tuple:
        """What a LoRA's shapes depend on: a sample model must share it with the trained one."""
        ...

    def training_rope(self, model: nn.Module, grid: tuple[int, int], references: int, text_tokens: int):
        """The RoPE tables of one training example: `text_tokens` text tokens, an h x w target, `references`
        reference images of the same grid."""
        ...

    def training_velocity(self, model: nn.Module, xt, ctx, *, sigma, rope, refs, checkpoint: bool) -> mx.array:
        """The velocity (B, L, C) of noisy target tokens xt (B, L, C) float32 at sigma (B,) float32, with the
        captions ctx (B, Lt, E) and clean reference tokens refs (B, Lr, C) or None, in the model dtype."""
        ...

    def steps(self, model: nn.Module, job: Job, *, dtype: mx.Dtype, reference_kv: bool, low_memory: bool) -> Steps:
        """What one image's steps share (RoPE tables, projected text, ...), built once."""
        ...
