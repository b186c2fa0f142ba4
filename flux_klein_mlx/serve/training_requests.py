"""A fine-tuning job's request (POST /v1/fine_tuning/jobs, OpenAI's body) -> the keyword arguments of
`train_lora`, i.e. the fields of `train/settings.TrainSettings`, which check them as `train` does.

OpenAI's fields map onto `train`'s options: `seed`; `hyperparameters` `n_epochs` (--epochs),
`batch_size` (--batch-size), `learning_rate_multiplier` (times --lr's default); every other option comes
under the extra field `training` by its `train` name (`sample_prompts` or `sample-prompt`, ...). What names a
file or folder is the server's to choose: the data and control folders come from uploaded file ids, the
model from the served ones, the output and work folder from the job; a `training` option naming a path is
refused. This module only maps and refuses; every value is checked by `TrainSettings.check` and
`train/plan.plan_run`.
"""

from __future__ import annotations

import math
import re

from ..train.settings import TrainSettings
from .forms import ApiError

JOB_FIELDS = {
    "model",
    "training_file",
    "validation_file",
    "seed",
    "suffix",
    "hyperparameters",
    "method",
    "training",
    "metadata",
    "integrations",
    "dry_run",  # ours: the checks and the memory plan only, no job (the page's "see the plan before starting")
}
HYPERPARAMETERS = {"n_epochs": "epochs", "batch_size": "batch_size", "learning_rate_multiplier": "lr"}
# `train` options that name a file or folder on the server, or the run's own place: never a request's.
SERVER_CHOSEN = {
    "data": "training_file",
    "controls": "training_file (its control/ folders)",
    "validation": "validation_file",
    "validation_controls": "validation_file (its control/ folders)",
    "model": "model",
    "output": "suffix",
    "work_dir": "the job",
    "resume": "POST /v1/fine_tuning/jobs/{id}/resume",
    "init_lora": None,
    "sample_images": None,
    "config": None,
}
ALIASES = {"sample_prompt": "sample_prompts", "control": "controls", "sample_image": "sample_images"}  # CLI names
SUFFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,39}")


def check_fields(body: dict) -> None:
    unknown = next((key for key in body if key not in JOB_FIELDS), None)
    if unknown is not None:
        raise ApiError(
            400,
            f"unknown field {unknown!r}; a job takes {', '.join(sorted(JOB_FIELDS))} (train's options: 'training')",
            unknown,
        )
    if body.get("dry_run") not in (None, True, False):
        raise ApiError(400, f"dry_run must be true or false, not {body['dry_run']!r}", "dry_run")
    if body.get("integrations"):
        raise ApiError(400, "integrations are not supported here; leave them out", "integrations")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise ApiError(400, "metadata must be an object of strings", "metadata")


def training_options(value) -> dict:
    """The `training` field -> TrainSettings fields, by `train`'s names (`sample-prompt`, `sample_prompts`)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, f"training must be an object of train's options, not {type(value).__name__}", "training")
    out = {}
    fields = TrainSettings.__dataclass_fields__
    for key, v in value.items():
        name = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name in SERVER_CHOSEN:
            where = SERVER_CHOSEN[name]
            given = f"; it comes from {where}" if where else "; a job reads only its uploaded files and served models"
            raise ApiError(400, f"training option {key!r} names a file or folder on the server{given}", "training")
        if name not in fields:
            raise ApiError(
                400,
                f"training option {key!r} is not one of train's; see `train --help` (e.g. steps, rank, trigger)",
                "training",
            )
        if name in out:
            raise ApiError(400, f"training gives {name} twice (as {key!r} too); give it once", "training")
        out[name] = v
    return out


def hyperparameters(body: dict) -> dict:
    """OpenAI's hyperparameters (at the top, or in method.supervised) -> TrainSettings fields; "auto": the default."""
    given = body.get("hyperparameters")
    method = body.get("method")
    if method is not None:
        if not isinstance(method, dict) or method.get("type", "supervised") != "supervised":
            raise ApiError(400, "method must be {'type': 'supervised', ...}: a LoRA is trained supervised", "method")
        supervised = method.get("supervised")
        inner = supervised.get("hyperparameters") if isinstance(supervised, dict) else None
        if inner and given:
            raise ApiError(400, "give hyperparameters or method.supervised.hyperparameters, not both", "method")
        given = given or inner
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ApiError(
            400, "hyperparameters must be an object (n_epochs, batch_size, learning_rate_multiplier)", "hyperparameters"
        )
    out = {}
    for key, value in given.items():
        if key not in HYPERPARAMETERS:
            raise ApiError(
                400,
                f"hyperparameter {key!r} is unknown; give n_epochs, batch_size or learning_rate_multiplier "
                "(train's other options go under 'training')",
                f"hyperparameters.{key}",
            )
        if value == "auto":
            continue
        if key == "learning_rate_multiplier":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not ok:
                raise ApiError(400, f"learning_rate_multiplier must be a number above 0 or 'auto', not {value!r}", key)
            value = TrainSettings.lr * value  # times the default lr (train --lr)
        out[HYPERPARAMETERS[key]] = value
    return out


def merged(hyper: dict, training: dict) -> dict:
    """hyperparameters and training together; one setting given both ways is refused, and so are n_epochs
    with steps (as `train` refuses --epochs with --steps)."""
    for name in hyper:
        if name in training:
            raise ApiError(400, f"{name} is given in hyperparameters and in training; give it once", "training")
    both = {**hyper, **training}
    if both.get("epochs") is not None and "steps" in both:
        raise ApiError(400, "give n_epochs (epochs) or training.steps, not both: the epochs set the steps", "training")
    return both


def check_suffix(value) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not SUFFIX.fullmatch(value):
        raise ApiError(
            400, f"suffix must be up to 40 letters, digits, '.', '_' or '-' (a file name part), not {value!r}", "suffix"
        )
    return value


def public_hyperparameters(settings: dict) -> dict:
    """The job object's hyperparameters, as OpenAI names them, from its settings."""
    lr = settings.get("lr", TrainSettings.lr)
    return {
        "n_epochs": settings.get("epochs") or "auto",
        "batch_size": settings.get("batch_size", TrainSettings.batch_size),
        "learning_rate_multiplier": lr / TrainSettings.lr,
    }
