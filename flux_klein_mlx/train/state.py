"""The work folder of a training run: checkpoints written crash-safe, train.json, loss.png.

    ink.train/                      (default: <output stem>.train/ next to the output)
        train.json                  every setting, the data list with hashes, versions
        loss.png                    the loss of every step and its moving average
        checkpoint-000250/
            lora.safetensors        diffusers/PEFT format, float32: loads with --lora as it is
            optimizer.safetensors   AdamW's moments and step count
            state.json              step, the epoch's batch order and position, RNG state, losses, run key
        samples/step-000250-0.png

A checkpoint is written into a temporary folder, flushed and renamed into place when complete
(output.folder_transaction; a rename is atomic), so a crash or a full disk leaves the earlier
checkpoints as they were. Only the newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import mlx.core as mx
from PIL import Image, ImageDraw

from ..errors import FluxKleinError
from ..output import folder_transaction, write_replacing
from ..weights import read_lora_file, read_safetensors, save_safetensors_streaming

_CHECKPOINT = re.compile(r"^checkpoint-(\d{6,})$")
# The temporary names of output.folder_transaction (checkpoints) and output.write_replacing (files).
_TEMPORARY = re.compile(r"^(checkpoint-\d+\.(tmp|old)-[0-9a-f]{8}|\..+\.[0-9a-f]{8}\.tmp)$")


def checkpoints(work_dir: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in `work_dir`, oldest first, as (step, folder)."""
    if not work_dir.is_dir():
        return []
    found = []
    for p in work_dir.iterdir():
        m = _CHECKPOINT.match(p.name)
        if m and (p / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def remove_temporaries(work_dir: Path) -> None:
    """Delete what an interrupted write of ours left behind (our own temporary names only)."""
    for p in work_dir.iterdir() if work_dir.is_dir() else []:
        if _TEMPORARY.match(p.name):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def write_checkpoint(
    work_dir: Path, step: int, lora: tuple[dict, dict], optimizer: dict[str, mx.array], state: dict, keep: int,
    extra: dict | None = None,
) -> Path:
    """Write checkpoint `step` (lora = (tensors, header metadata)) and drop all but the newest `keep`;
    `extra` maps more file names to (tensors, metadata) (ema.safetensors).

    On an OSError (a full disk, say) nothing of the new checkpoint remains and the earlier ones are
    untouched; the FluxKleinError names the last good one.
    """
    final = work_dir / f"checkpoint-{step:06d}"
    try:
        with folder_transaction(final, durable=True) as tmp:  # the same step written before is replaced whole
            save_safetensors_streaming(tmp / "lora.safetensors", dict(lora[0]), metadata=lora[1])
            save_safetensors_streaming(tmp / "optimizer.safetensors", dict(optimizer), metadata={"format": "mlx"})
            for name, (tensors, metadata) in (extra or {}).items():
                save_safetensors_streaming(tmp / name, dict(tensors), metadata=metadata)
            (tmp / "state.json").write_text(json.dumps(state))
    except (OSError, FluxKleinError) as e:
        done = checkpoints(work_dir)
        last = f"{done[-1][1]} (step {done[-1][0]})" if done else "none yet"
        why = (e.strerror or e) if isinstance(e, OSError) else e
        raise FluxKleinError(
            f"cannot write checkpoint {final.name} ({why}); the last good checkpoint is {last}: "
            "free some space and continue with --resume"
        ) from None
    for _, old in checkpoints(work_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_checkpoint(folder: Path) -> tuple[dict[str, mx.array], dict[str, mx.array], dict]:
    """(LoRA tensors without the `transformer.` prefix, optimizer tensors, state) of one checkpoint."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise FluxKleinError(f"checkpoint {folder} is damaged ({e}); resume from another or start anew") from None
    tensors, _, _ = read_lora_file(folder / "lora.safetensors")
    lora = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    optimizer = read_safetensors(folder / "optimizer.safetensors")
    mx.eval(optimizer)
    return lora, optimizer, state


def read_state(folder: Path) -> dict:
    """A checkpoint's state.json alone (for the resume checks, before any model loads)."""
    try:
        return json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise FluxKleinError(f"checkpoint {folder} is damaged ({e}); resume from another or start anew") from None


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write a file of the work folder through a temporary name and a rename (replacing the old one)."""
    try:
        write_replacing(path, write)
    except OSError as e:
        raise FluxKleinError(f"cannot write {path} ({e.strerror or e}); free some space and continue with --resume") from None


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the first ones average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_plot(losses: list[float], first_step: int = 1, size: tuple[int, int] = (800, 400), validation=()) -> Image.Image:
    """The loss per step (grey) and its moving average (blue) over a window of ~1/20 of the run;
    `validation` (step, loss) pairs as red dots."""
    W, H = size
    left, right, top, bottom = 70, 20, 34, 40
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    window = max(1, len(losses) // 20)
    draw.text((left, 8), f"training loss: per step (grey), moving average over {window} steps (blue)", fill="black")
    if not losses:
        return img
    smooth = moving_average(losses, window)
    lo, hi = min(losses + [v for _, v in validation]), max(losses + [v for _, v in validation])
    hi = hi if hi > lo else lo + 1e-6
    n = len(losses)

    def xy(i: int, v: float) -> tuple[float, float]:
        x = left + (W - left - right) * (i / max(n - 1, 1))
        return x, top + (H - top - bottom) * (1 - (v - lo) / (hi - lo))

    draw.rectangle([left, top, W - right, H - bottom], outline="black")
    draw.line([xy(i, v) for i, v in enumerate(losses)] if n > 1 else [xy(0, losses[0])] * 2, fill=(190, 190, 190))
    draw.line([xy(i, v) for i, v in enumerate(smooth)] if n > 1 else [xy(0, smooth[0])] * 2, fill=(30, 80, 220), width=2)
    for step, v in validation:
        x, y = xy(step - first_step, v)
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(220, 40, 40))
    if validation:
        draw.text((W - right - 150, 8), "validation loss (red)", fill=(220, 40, 40))
    draw.text((4, top - 6), f"{hi:.4g}", fill="black")
    draw.text((4, H - bottom - 6), f"{lo:.4g}", fill="black")
    draw.text((left, H - bottom + 6), f"step {first_step}", fill="black")
    last = f"step {first_step + n - 1}"
    draw.text((W - right - 7 * len(last), H - bottom + 6), last, fill="black")
    return img


def write_loss_plot(path: Path, losses: list[float], validation=()) -> None:
    write_atomic(path, lambda tmp: loss_plot(losses, validation=list(validation)).save(tmp, format="PNG"))
