"""`train --config FILE`: the settings of a run from a TOML file or from a previous run's train.json.

A TOML file's keys are the command's long option names with underscores (`lr_scheduler = "cosine"`,
`resolution = [512, 768]`, `control = ["before/"]`, `model`, `data`, `output`); a train.json gives
its "settings" (all but `work_dir` and `resume`, which say where a run lives, not what it computes),
and its "data" list, whose sha256 hashes `check_recorded_data` compares with the files now. Unknown
keys are an error that names them. Which of these values the command line overrides is the
command's business (train/command.py); this module only reads and checks.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import FluxKleinError, first_few
from .data.dataset import IMAGE_SUFFIXES, caption_of, file_sha256, with_trigger
from .settings import TrainSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NOT_FROM_RECORD = ("work_dir", "resume")  # where a recorded run lived; a new run chooses its own


@dataclass
class ConfigFile:
    path: Path
    settings: dict  # setting name (TrainSettings field) -> value
    recorded_data: list | None  # train.json's "data" entries (None for TOML)


def read_config(path, names: dict[str, str]) -> ConfigFile:
    """Read a .toml file or a train.json; `names` maps every accepted key to its setting name."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FluxKleinError(f"--config {p} is not a file; give a .toml file or a run's train.json")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows' Notepad writes one) is not TOML
    except (OSError, UnicodeDecodeError) as e:
        raise FluxKleinError(f"cannot read --config {p} ({getattr(e, 'strerror', None) or e})") from None
    if p.suffix.lower() == ".json":
        return _from_record(p, text, names)
    if p.suffix.lower() != ".toml":
        raise FluxKleinError(
            f"--config {p}: give a .toml file or a run's train.json, not a {p.suffix or 'suffix-less'} file"
        )
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FluxKleinError(f"--config {p} is not valid TOML ({e})") from None
    unknown = sorted(k for k in raw if k not in names)
    if unknown:
        raise FluxKleinError(
            f"--config {p}: unknown key(s) {', '.join(unknown)}; the keys are the long option names with "
            "underscores (see train --help)"
        )
    settings = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            raise FluxKleinError(f"--config {p}: {key} is a table; give each setting as a plain key = value")
        settings[names[key]] = value
    return ConfigFile(p, settings, None)


def _from_record(p: Path, text: str, names: dict[str, str]) -> ConfigFile:
    try:
        record = json.loads(text)
    except ValueError as e:
        raise FluxKleinError(f"--config {p} is not valid JSON ({e}); give a run's train.json or a .toml file") from None
    settings = record.get("settings") if isinstance(record, dict) else None
    if not isinstance(settings, dict):
        raise FluxKleinError(f'--config {p} has no "settings"; give the train.json of a training run')
    known = set(names.values()) | set(TrainSettings.__dataclass_fields__)
    unknown = sorted(k for k in settings if k not in known and k not in NOT_FROM_RECORD)
    if unknown:
        raise FluxKleinError(f"--config {p}: unknown setting(s) {', '.join(unknown)} (from another version?)")
    kept = {k: v for k, v in settings.items() if k not in NOT_FROM_RECORD}
    data = record.get("data")
    return ConfigFile(p, kept, data if isinstance(data, list) else None)


def check_recorded_data(config: ConfigFile, data_folder) -> None:
    """The images (and controls) of `data_folder` are those the recorded run trained on, byte for
    byte, and so are their captions: a changed, missing or added image, or a changed caption, is an
    error that names it."""
    folder = Path(data_folder).expanduser()
    recorded: dict[str, str] = {}
    controls: dict[str, str] = {}
    for entry in config.recorded_data or []:  # one entry per (image, resolution): the same hashes
        recorded[entry["image"]] = entry["sha256"]
        for c in entry.get("controls", []):
            controls[c["image"]] = c["sha256"]
    present = (
        sorted(q.name for q in folder.iterdir() if q.suffix.lower() in IMAGE_SUFFIXES and not q.name.startswith("."))
        if folder.is_dir()
        else []
    )
    added = [name for name in present if name not in recorded]
    if added:
        raise FluxKleinError(
            f"--data {folder} holds {added[0]}, which {config.path} did not train on; "
            "give --data to train on this folder as it is now"
        )
    for name, sha in list(recorded.items()) + list(controls.items()):
        image = Path(name) if Path(name).is_absolute() else folder / name
        if not image.is_file():
            raise FluxKleinError(f"{image} is gone since {config.path}; restore it, or give --data to train without it")
        if file_sha256(image) != sha:
            raise FluxKleinError(
                f"{image} changed since {config.path} (sha256 differs); restore it, or give --data "
                "to train on the folder as it is now"
            )
    _check_recorded_captions(config, folder)


def _check_recorded_captions(config: ConfigFile, folder: Path) -> None:
    """Each image's caption, read as the recorded run read it (its --caption-extension, --caption and
    --trigger), is the caption it trained on: an edited, added or removed caption file is named."""
    recorded = {e["image"]: e.get("caption") for e in config.recorded_data or []}
    extension = config.settings.get("caption_extension") or ".txt"
    changed = []
    for name, caption in recorded.items():
        now = caption_of(folder / name, config.settings.get("caption"), extension)
        if (with_trigger(now[0], config.settings.get("trigger")) if now else None) != caption:
            changed.append(Path(name).with_suffix(extension).name)
    if changed:
        raise FluxKleinError(
            f"the caption(s) {first_few(changed)} in {folder} changed since {config.path}; restore them, or give "
            "--data to train on the folder as it is now"
        )


def option_names(command) -> dict[str, str]:
    """Every key a TOML config accepts for a click command: each long option name with underscores,
    and each setting name, -> the setting name (`--control` -> controls, `--sample-prompt` -> sample_prompts)."""
    names: dict[str, str] = {}
    for param in command.params:
        if param.name == "config":
            continue
        names[param.name] = param.name
        for opt in param.opts:
            if opt.startswith("--"):
                names[opt[2:].replace("-", "_")] = param.name
    return names
