"""Issue 39: the metrics log (train/report/metrics.py): `metrics.jsonl` in the work folder holds every step's numbers
as the run reported them (and each validation), once per step across a resume; TensorBoard event files
(tensorboardX, when installed) hold the same scalars, read back with tensorboardX's own protobuf classes.
"""

from __future__ import annotations

import json
import struct

import pytest
from test_settings import make_images

import flux_klein_mlx
import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx.train.report.evaluation import ValidationFinished
from flux_klein_mlx.train.report.events import StepFinished


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def events_of(folder) -> list:
    """Every Event of the tfevents files in `folder`, in file order (TFRecord: length, crc, data, crc)."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2", reason="the TensorBoard writer: tensorboardX")
    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        blob = path.read_bytes()
        at = 0
        while at < len(blob):
            (n,) = struct.unpack_from("<Q", blob, at)
            out.append(event_pb2.Event.FromString(blob[at + 12 : at + 12 + n]))
            at += 12 + n + 4
    return out


def scalars(events, tag: str) -> dict[int, float]:
    return {e.step: v.simple_value for e in events for v in e.summary.value if v.tag == tag}


def test_metrics_jsonl_and_tensorboard_hold_each_step_once_across_a_resume(base, tmp_path, monkeypatch):
    """A run stopped in step 4 with its checkpoint at 2 (steps 1-3 logged), resumed to 5: metrics.jsonl holds
    steps 1..5 once each, step 1-2 as the first run reported them, 3-5 as the resume did, the validation
    at each checkpoint; the events hold the same losses, and the resume's file starts with TensorBoard's
    purge marker at step 3 (a SessionLog START: the first run's step 3 is dropped on reading)."""
    data, held = make_images(tmp_path / "data"), make_images(tmp_path / "held", n=1)
    # float32: bf16 is emulated on a CPU (slower), and the log, not the dtype, is what is checked
    common = dict(model=base, data=data, rank=4, resolution=64, save_every=2, validation=held, lr=1e-3, dtype="float32")
    real = train_module.Trainer.train_step

    def stop_at_4(self):
        if self.step_no == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(train_module.Trainer, "train_step", stop_at_4)
    first = []
    with pytest.raises(KeyboardInterrupt):
        for ev in flux_klein_mlx.train_lora(output=tmp_path / "a.safetensors", steps=5, **common):
            first.append(ev)
    work = tmp_path / "a.train"
    assert [d["step"] for d in lines(work / "metrics.jsonl") if "loss" in d] == [1, 2, 3]
    monkeypatch.setattr(train_module.Trainer, "train_step", real)
    second = list(flux_klein_mlx.train_lora(output=tmp_path / "a.safetensors", steps=5, resume=True, **common))
    logged = lines(work / "metrics.jsonl")
    steps = [d for d in logged if "loss" in d]
    reported = [e for e in first if isinstance(e, StepFinished)][:2] + [
        e for e in second if isinstance(e, StepFinished)
    ]
    assert [d["step"] for d in steps] == [1, 2, 3, 4, 5]
    for d, ev in zip(steps, reported, strict=True):
        assert (d["step"], d["loss"], d["lr"], d["grad_norm"], d["average"]) == (
            ev.step,
            ev.loss,
            ev.lr,
            ev.grad_norm,
            ev.average,
        )
    state = json.loads((work / "checkpoint-000004" / "state.json").read_text())
    assert [d["loss"] for d in steps[:4]] == state["losses"]
    validations = [e for e in first + second if isinstance(e, ValidationFinished)]
    assert [(d["step"], d["validation_loss"]) for d in logged if "validation_loss" in d] == [
        (v.step, v.loss) for v in validations
    ]
    events = events_of(work / "tensorboard")
    losses = scalars(events, "train/loss")
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert all(losses[d["step"]] == pytest.approx(d["loss"], rel=1e-6) for d in steps)  # float32 in the events
    assert scalars(events, "validation/loss")[2] == pytest.approx(validations[0].loss, rel=1e-6)
    purges = [e.step for e in events if e.HasField("session_log") and e.session_log.status == 1]  # START
    assert purges == [3]
