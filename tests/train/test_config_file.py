"""`train --config FILE` reads what a stranger wrote (issue 46): any TOML text, and any JSON as a run's
train.json, either becomes settings that `TrainSettings.check` accepts or is refused with one line
(FluxKleinError); never another exception. Property-based (Hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.train.command import train
from flux_klein_mlx.train.config_file import option_names, read_config
from flux_klein_mlx.train.settings import TrainSettings

NAMES = option_names(train)
KEYS = sorted(NAMES)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
SCALAR = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.booleans(), TEXT)
VALUE = st.one_of(SCALAR, st.lists(SCALAR, max_size=3))


def toml_value(v) -> str:
    """One TOML value: JSON's string escapes, numbers and lists are TOML's too (nan/inf spelled TOML's way)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)


def one_line(e: FluxKleinError) -> bool:
    return "\n" not in str(e) and str(e) != ""


def settings_or_refusal(path) -> None:
    try:
        config = read_config(path, NAMES)
        fields = {k: v for k, v in config.settings.items() if k in TrainSettings.__dataclass_fields__}
        TrainSettings(**{"data": "d", "output": "o.safetensors", **fields}).check()
    except FluxKleinError as e:
        assert one_line(e), str(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(KEYS), VALUE, max_size=4))
def test_any_toml_of_known_keys_is_settings_or_one_line(tmp_path, table):
    path = tmp_path / "run.toml"
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in table.items()), encoding="utf-8")
    settings_or_refusal(path)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_any_bytes_as_a_toml_file_are_settings_or_one_line(tmp_path, data):
    path = tmp_path / "run.toml"
    path.write_bytes(data)
    settings_or_refusal(path)


JSON = st.recursive(
    SCALAR | st.none(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(JSON, st.fixed_dictionaries({"settings": st.dictionaries(st.sampled_from(KEYS), VALUE, max_size=4)})))
def test_any_json_as_a_runs_train_json_is_settings_or_one_line(tmp_path, record):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(record), encoding="utf-8")
    settings_or_refusal(path)


def test_a_number_as_the_sample_prompts_is_one_line(tmp_path):
    """Found by the property above: `sample_prompt = 0` in a TOML was a TypeError ('int' object is not iterable)."""
    path = tmp_path / "run.toml"
    path.write_text("sample_prompt = 0\n", encoding="utf-8")
    settings = read_config(path, NAMES).settings
    with pytest.raises(FluxKleinError, match=r"^sample-prompt must be a text or a list of texts, not 0$"):
        TrainSettings(data="d", output="o.safetensors", **settings).check()
