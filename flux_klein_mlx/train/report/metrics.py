"""The run's metrics as the trainers' tools read them: `metrics.jsonl` in the work folder, one JSON object a
line, and TensorBoard event files in `tensorboard/` when tensorboardX is installed (`pip install
tensorboardX`; without it, metrics.jsonl alone; docs/training.md#metrics).

    {"step": 12, "loss": 0.41, "average": 0.44, "lr": 0.0001, "grad_norm": 0.8, "seconds": 1.9,
     "peak_memory": 4012345678, "epoch": 2}
    {"step": 250, "validation_loss": 0.39, "validation_by_sigma": {"0.1": 0.2, ...}}

TensorBoard gets the same numbers as scalars at the same step, tagged by group and name: the step's
numbers in the group "train" (loss, average, lr, grad_norm, seconds, peak_memory, epoch), the
validation's in the group "validation" (loss, and sigma_0.1 ... for its loss at each noise level).
A resume continues both where its checkpoint is: the lines (and events) of steps
past it, logged by the run that stopped, are dropped (tensorboardX's purge_step), so each step is
there once.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from ...storage.files import open_no_follow, write_replacing

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_FOLDER = "tensorboard"


def tensorboard_writer(folder: Path, first_step: int):
    """tensorboardX's SummaryWriter on `folder` (events of steps >= `first_step` purged), or None where
    tensorboardX is not installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(folder), purge_step=first_step if first_step > 1 else None)


class MetricsLog:
    """metrics.jsonl (and TensorBoard's events) of one run in `work_dir`, continued after step `resumed_at`."""

    def __init__(self, work_dir: Path, resumed_at: int = 0, tensorboard: bool = True):
        self.path = Path(work_dir) / METRICS_FILE
        self.off = False  # a failed write turns the log off (once, said)
        self._keep_until(resumed_at)
        self.writer = tensorboard_writer(Path(work_dir) / TENSORBOARD_FOLDER, resumed_at + 1) if tensorboard else None

    def _keep_until(self, step: int) -> None:
        """Drop the lines of steps after `step` (a resume's checkpoint); none at all for a new run."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash: dropped
        write_replacing(self.path, lambda tmp: tmp.write_text("".join(kept)))

    def write(self, step: int, values: dict, group: str = "train") -> None:
        """One line {"step": step, **values}; each number also a TensorBoard scalar `group/name`. A line that
        cannot be written (a full disk) turns the log off with one warning: the run goes on (its checkpoints
        say what a full disk means for them)."""
        if self.off:
            return
        line = json.dumps({"step": step, **values}, separators=(", ", ": ")) + "\n"
        try:
            fd = open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:
            self.off = True
            warnings.warn(
                f"cannot write {self.path} ({e.strerror or e}); the run goes on without its metrics log", stacklevel=2
            )
            return
        if self.writer is not None:
            for name, value in _scalars(values, group):
                self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _scalars(values: dict, group: str) -> list[tuple[str, float]]:
    """(tag, number) of a line's numbers: `group/name`, a dict's entries as `group/name_key`."""
    out = []
    for name, value in values.items():
        short = name.removeprefix(f"{group}_")
        if isinstance(value, dict):
            out += [(f"{group}/sigma_{k}", float(v)) for k, v in value.items()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((f"{group}/{short}", float(value)))
    return out
