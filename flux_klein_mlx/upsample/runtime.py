"""The prompt upsampler's model on MLX, run by mlx-vlm (the optional extra `upsample`).

BFL's upsampler (black-forest-labs/flux-3-image-klein-pup) is a Qwen3.5-9B vision-language fine-tune:
a hybrid of gated-DeltaNet and attention layers with a vision tower. mlx-vlm carries that architecture,
its image processor and its generation loop, and keeps them current; we use it rather than a port of
our own (README.md, docs/flux3.md#the-prompt-upsampler). What is ours: the request (`request`), a folder
checked before loading (one line for a damaged one), greedy decoding to diffusers' rule (no sampling, no
penalty, at most 3584 new tokens, stopping at the folder's generation_config eos ids, decoded without
special tokens), and the release of the model (its memory) as soon as the caption is written.

    with Upsampler(folder) as up:      # loads on the first caption; released on leaving the block
        caption = up.caption(request, on_progress)
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from ..errors import FluxKleinError
from ..storage.files import folder_transaction
from ..storage.weights import check_safetensors_file, resolve_model
from .request import MAX_NEW_TOKENS, UpsampleRequest

INSTALL_HINT = 'pip install -e ".[upsample]" (or pip install mlx-vlm==0.7.10)'
UPSAMPLER_TYPES = ("qwen3_5",)  # config.json model_type of the upsampler's architecture
UPSAMPLER_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt"]  # what a hub download of the upsampler takes
# Tokens per prefill pass. The prefill's work grows ~0.8 MB a prompt token at full size (benchmarks/MEMORY.md
# section 6): mlx-vlm's default of 2048 ran a one-reference edit's 1621 tokens as one pass, 7.29 GB with the
# 4-bit upsampler; passes of 512 keep it under 7 GB. Each pass still multiplies 512-row matrices.
PREFILL_CHUNK = 512


class Progress(NamedTuple):
    """What the caption has reached: the new text, the tokens so far and their rate."""

    text: str
    tokens: int
    tokens_per_second: float


def mlx_vlm_modules():
    """(load, stream_generate) of mlx-vlm, or one line saying how to install it."""
    try:
        from mlx_vlm import load
        from mlx_vlm.generate import stream_generate
    except ImportError:
        raise FluxKleinError(f"{{upsample}} needs mlx-vlm, which is not installed: {INSTALL_HINT}") from None
    return load, stream_generate


def _damaged(folder: Path, why: str) -> FluxKleinError:
    return FluxKleinError(
        f"the prompt upsampler folder {folder} is damaged or incomplete ({why}); download it again "
        "(black-forest-labs/flux-3-image-klein-pup) or point --upsampler at a whole copy"
    )


UPSAMPLER_HINT = "give --upsampler black-forest-labs/flux-3-image-klein-pup or a copy of it"


def _pipeline_kind(folder: Path) -> str:
    """What a folder with a model_index.json is: "a diffusers Flux2KleinPipeline folder" (a whole model)."""
    try:
        name = json.loads((folder / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        name = None
    return f"a diffusers {name} folder (a whole image model)" if isinstance(name, str) else "a diffusers model folder"


def upsampler_weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files, each header checked, after its config: one line if anything is wrong."""
    if not (folder / "config.json").exists() and (folder / "model_index.json").is_file():
        raise FluxKleinError(f"{folder} is {_pipeline_kind(folder)}, not a FLUX 3 prompt upsampler; {UPSAMPLER_HINT}")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise _damaged(folder, f"config.json: {type(e).__name__}") from None
    if not isinstance(config, dict) or config.get("model_type") not in UPSAMPLER_TYPES:
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise FluxKleinError(
            f"{folder} is not a FLUX 3 prompt upsampler (config.json model_type {kind!r}, not qwen3_5); "
            + UPSAMPLER_HINT
        )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise _damaged(folder, "no *.safetensors weights")
    for file in files:
        try:
            check_safetensors_file(file)
        except FluxKleinError as e:
            raise _damaged(folder, str(e)) from None
    if not (folder / "tokenizer.json").is_file():
        raise _damaged(folder, "no tokenizer.json")
    return files


def stop_ids(folder: Path) -> list[int]:
    """The token ids that end a caption: generation_config.json's eos (what transformers' generate stops at)."""
    for name in ("generation_config.json", "config.json"):
        try:
            ids = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if ids is not None:
            return [ids] if isinstance(ids, int) else list(ids)
    return []


def upsampler_folder(source: str | Path) -> Path:
    """The upsampler's folder: a local one, or a hub repo id found in (or downloaded into) the hub cache."""
    return resolve_model(source, allow_patterns=UPSAMPLER_FILES)


def is_upsampler(source: str | Path, repo: str | None) -> bool:
    """Whether `convert`/`quantize` were given the prompt upsampler: its hub repo id `repo`, or a folder whose
    config.json is Qwen3.5's."""
    if str(source) == repo:
        return True
    try:
        return json.loads((Path(source) / "config.json").read_text()).get("model_type") in UPSAMPLER_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def convert_upsampler(source: str | Path, output: str | Path, *, bits: int | None, group_size: int, overwrite: bool):
    """Write the upsampler as an MLX folder (mlx-vlm's layout, `bits` 4 or 8 or None: as stored) at `output`,
    whole or not at all; mlx-vlm's convert does the work (its progress lines go to stderr)."""
    import contextlib
    import sys

    if bits not in (None, 4, 8) or group_size not in (32, 64, 128):
        raise FluxKleinError(
            f"the upsampler is quantized to 4 or 8 bits in groups of 32, 64 or 128, not {bits}/{group_size}"
        )
    folder, output = upsampler_folder(source), Path(output)
    if output.exists() and (not overwrite or output.resolve() == folder.resolve()):
        raise FluxKleinError(f"{output} exists; give another --output (or --overwrite to replace it, not the source)")
    upsampler_weight_files(folder)
    try:
        from mlx_vlm.convert import convert
    except ImportError:
        raise FluxKleinError(
            f"converting the prompt upsampler needs mlx-vlm, which is not installed: {INSTALL_HINT}"
        ) from None
    with folder_transaction(output) as tmp, contextlib.redirect_stdout(sys.stderr):
        convert(str(folder), str(tmp), quantize=bits is not None, q_bits=bits or 4, q_group_size=group_size)
    return output


class Upsampler:
    """The upsampler in `folder`, loaded on first use, released by `release()` (or leaving a `with`)."""

    def __init__(self, folder: str | Path, max_new_tokens: int = MAX_NEW_TOKENS):
        self.folder = Path(folder)
        self.max_new_tokens = max_new_tokens
        self.model = self.processor = None
        self.load_seconds = 0.0
        self.make_room: Callable[[], None] | None = None  # called before loading (the pipeline drops its transformer)

    def __enter__(self) -> Upsampler:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def load(self) -> None:
        if self.model is not None:
            return
        load, _ = mlx_vlm_modules()
        upsampler_weight_files(self.folder)
        if self.make_room is not None:
            self.make_room()
        t0 = time.perf_counter()
        try:
            self.model, self.processor = load(str(self.folder))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise _damaged(
                self.folder, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            ) from None
        # Exactly the folder's eos ids, as transformers' generate stops (mlx-vlm's reset would add the tokenizer's).
        self.processor.tokenizer.stopping_criteria.eos_token_ids = stop_ids(self.folder)
        self.load_seconds += time.perf_counter() - t0

    def release(self) -> None:
        """Drop the model and give its memory back (before the transformer loads)."""
        self.model = self.processor = None
        gc.collect()
        mx.clear_cache()

    def answer_ids(self, request: UpsampleRequest, on_progress: Callable[[Progress], None] | None = None) -> list[int]:
        """The token ids of the upsampler's greedy answer (the stop token included when it came)."""
        self.load()
        _, stream_generate = mlx_vlm_modules()
        chat = self.processor.apply_chat_template(
            request.messages(), tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        last = None
        for last in stream_generate(
            self.model,
            self.processor,
            chat,
            image=list(request.references) or None,
            max_tokens=self.max_new_tokens,
            temperature=0.0,
            prefill_step_size=PREFILL_CHUNK,
        ):
            if on_progress is not None and last.token is not None:
                on_progress(Progress(last.text, last.generation_tokens, last.generation_tps))
        return list(getattr(last, "token_ids", None) or [])

    def caption(self, request: UpsampleRequest, on_progress: Callable[[Progress], None] | None = None) -> str:
        """The caption for `request`: the answer decoded without special tokens, reconciled with locked boxes."""
        ids = self.answer_ids(request, on_progress)
        return request.finish(self.processor.tokenizer.decode(ids, skip_special_tokens=True))
