"""Issue 46, section 1: every count a user, a file or a request can give has an upper bound (limits.py),
checked before any model loads, with the bound in its one line; the same bound at every door.

The memory cases run the command in a child under an address-space cap (resource.setrlimit): today's
code grew without bound there (a list of 10^9 sigmas); the bound refuses at once, memory flat.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from command_line import assert_one_line_error, gen_args
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from flux_klein_mlx import limits
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.inputs.outpaint import parse_outpaint
from flux_klein_mlx.inputs.settings import RunSettings
from flux_klein_mlx.record.output import RECORD_KEY
from flux_klein_mlx.run.pipeline import load
from flux_klein_mlx.sampling import schedule, shifted_schedule
from flux_klein_mlx.serve.forms import ApiError, parse_size

ROOT = Path(__file__).resolve().parents[1]
CAP = 2 << 30  # bytes of address space the child may map: MLX and the package load in less


def capped_cli(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    """`flux-klein-mlx ARGS` in a child limited to CAP bytes of memory."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP}))\n"
        "from flux_klein_mlx.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


# --- steps: the schedule's real ceiling ---------------------------------------------------------------------


def test_the_step_bound_is_where_the_schedules_still_hold():
    """At MAX_STEPS both families' schedules are n + 1 finite sigmas from 1 to 0, non-increasing (the
    smallest image, where FLUX.2's fitted shift falls fastest); past ~98,600 steps FLUX.2's is a
    ZeroDivisionError: the bound is far below it."""
    for sigmas in (schedule(16, limits.MAX_STEPS), shifted_schedule(limits.MAX_STEPS, 6.93)):
        assert len(sigmas) == limits.MAX_STEPS + 1 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
        assert all(a >= b for a, b in zip(sigmas, sigmas[1:], strict=False))
    with pytest.raises(ZeroDivisionError):
        schedule(16, 100_000)  # why a bound is needed at all (the 100,000 steps)


def test_a_records_steps_past_the_bound_refused_at_once_memory_flat(snapshot, tmp_path):
    """A picture from the web whose record says 10^9 steps, read by --from: the same bound, memory flat."""
    record = {"prompt": "a fox", "steps": 1_000_000_000, "seed": 1, "width": 64, "height": 64, "noise": "torch"}
    info = PngInfo()
    info.add_text(RECORD_KEY, json.dumps(record))
    Image.new("RGB", (64, 64)).save(tmp_path / "found.png", pnginfo=info)
    out = tmp_path / "x.png"
    done = capped_cli("generate", "--from", tmp_path / "found.png", "--model", snapshot, "-o", out)
    assert_one_line_error(done.returncode, done.stderr, f"[1, {limits.MAX_STEPS}]", "1000000000")
    assert not out.exists()


@pytest.mark.parametrize("steps", ["1000000000", "100000", str(limits.MAX_STEPS + 1)])
def test_generate_steps_past_the_bound_refused_at_once_memory_flat(snapshot, tmp_path, steps):
    out = tmp_path / "x.png"
    done = capped_cli(*gen_args(snapshot, out, "--steps", steps))
    assert_one_line_error(done.returncode, done.stderr, f"steps must be a whole number in [1, {limits.MAX_STEPS}]")
    assert not out.exists()


def test_python_steps_past_the_bound_refused_before_any_model(base, no_models):
    pipe = load(base)
    with pytest.raises(FluxKleinError, match=rf"steps must be a whole number in \[1, {limits.MAX_STEPS}\], not 1001"):
        pipe.generate("a fox", width=64, height=64, steps=1001)
    assert no_models == []


# --- references, prompts, outpaint pads, paths ------------------------------------------------------------


def test_more_references_than_the_bound_refused_before_any_is_opened(cli, family_distilled, tmp_path, no_models):
    """Eleven --image paths that do not even exist: the count is refused first, at the CLI and in Python,
    on either family's model."""
    many = [str(tmp_path / f"missing{i}.png") for i in range(limits.MAX_REFERENCES + 1)]
    images = [a for p in many for a in ("--image", p)]
    code, _, err = cli(*gen_args(family_distilled, tmp_path / "x.png", *images))
    assert_one_line_error(code, err, "11 reference images given", f"the limit is {limits.MAX_REFERENCES}")
    with pytest.raises(FluxKleinError, match=f"the limit is {limits.MAX_REFERENCES}"):
        RunSettings("a fox", images=many).check()
    assert no_models == [] and not (tmp_path / "x.png").exists()


def test_a_prompt_past_the_bound_refused_at_every_door(cli, snapshot, tmp_path, no_models):
    long = "a fox " * (limits.MAX_PROMPT_CHARS // 6 + 1)
    code, _, err = cli("generate", "--model", snapshot, "-p", long, "-o", tmp_path / "x.png")
    assert_one_line_error(code, err, "the prompt is", f"the limit is {limits.MAX_PROMPT_CHARS:,}")
    with pytest.raises(FluxKleinError, match="the negative prompt is .* characters long"):
        RunSettings("a fox", negative_prompt=long).check()
    assert RunSettings("x" * limits.MAX_PROMPT_CHARS).check()  # the bound itself is taken
    assert no_models == []


def test_outpaint_pads_past_the_canvas_refused_naming_the_side():
    for text, words in (("5000,0,0,0", "left 5000"), ("0,0,0,4033", "bottom 4033"), ("0,99999999999999,0,0", "top")):
        with pytest.raises(FluxKleinError, match=f"outpaint adds at most {limits.MAX_OUTPAINT_PAD} px a side") as e:
            parse_outpaint(text)
        assert words in str(e.value)
    assert parse_outpaint(f"{limits.MAX_OUTPAINT_PAD},0,0,0") == (limits.MAX_OUTPAINT_PAD, 0, 0, 0)


LONG_NAME = "a" * 300  # past every file system's 255-byte name


@pytest.mark.parametrize("option", ["--image", "--init-image", "-o", "--lora", "--model"])
def test_a_path_past_the_os_limit_is_one_line(cli, snapshot, tmp_path, option):
    """A path option past the OS's limits: one line (an OSError traceback before), nothing written."""
    path = tmp_path / f"{LONG_NAME}.png"
    args = gen_args(snapshot, tmp_path / "x.png")
    if option == "-o":
        args[args.index("-o") + 1] = path
    elif option == "--model":
        args[args.index("--model") + 1] = tmp_path / LONG_NAME
    else:
        args += [option, path]
    code, _, err = cli(*args)
    assert_one_line_error(code, err)
    assert any(w in err for w in ("too long", "file name is 304 bytes")), err  # -o: files.check_output_file's
    assert list(tmp_path.iterdir()) == []


def test_python_paths_past_the_limits_refused_before_the_os_sees_them(base, tmp_path, no_models):
    pipe = load(base)
    for image, words in (
        (tmp_path / f"{LONG_NAME}.png", f"a name of {len(LONG_NAME) + 4}"),
        ("/x" * 600, "1200 bytes"),
        ("a\0b.png", "NUL"),
    ):
        with pytest.raises(FluxKleinError, match=words) as e:
            pipe.generate("a fox", width=64, height=64, images=[image])
        assert "\n" not in str(e.value)
    assert no_models == []


# --- the parsers of what strangers give: any input parses or is one FluxKleinError line ---------------------


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=40),
        st.text(alphabet="0123456789,- x", max_size=40),
        st.lists(st.one_of(st.integers(-10, 10**9), st.floats(), st.text(max_size=5), st.none()), max_size=5),
        st.integers(),
    )
)
def test_outpaint_pads_parse_or_refuse_in_one_line(text):
    """--outpaint's "LEFT,TOP,RIGHT,BOTTOM", or Python's four numbers: valid pads or one line."""
    try:
        pads = parse_outpaint(text)
    except FluxKleinError as e:
        assert "\n" not in str(e)
        return
    assert len(pads) == 4 and any(pads) and all(0 <= p <= limits.MAX_OUTPAINT_PAD for p in pads)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=30),
        st.builds(lambda w, h: f"{w}x{h}", st.integers(-10, 10**7), st.integers(-10, 10**7)),
        st.none(),
        st.integers(),
        st.lists(st.integers(), max_size=3),
    )
)
def test_size_strings_parse_or_refuse_in_one_line(size):
    """The server's `size` ("WIDTHxHEIGHT"): a valid pair of sides or a 400 in one line, never another error."""
    try:
        w, h = parse_size(size)
    except ApiError as e:
        assert e.status == 400 and "\n" not in e.message and e.param == "size"
        return
    if w is not None:
        assert limits.MIN_SIDE <= w <= limits.MAX_SIDE and limits.MIN_SIDE <= h <= limits.MAX_SIDE
        assert w % 16 == 0 and h % 16 == 0


def test_the_cap_itself_lets_a_refusal_run(tmp_path):
    """The memory cap is no cause of a failure: a plain refusal under it is the usual one line."""
    done = capped_cli("generate", "-p", " ", "-o", tmp_path / "x.png")
    assert_one_line_error(done.returncode, done.stderr, "the prompt is empty")
    assert resource.getrlimit(resource.RLIMIT_AS)[0] != CAP  # only the child was capped


@pytest.mark.parametrize("seed", [limits.MAX_SEED + 1, limits.MIN_SEED - 1, 10**23])
def test_a_seed_past_torchs_range_refused_at_every_door(cli, snapshot, tmp_path, no_models, seed):
    """Issue 46: a seed torch.Generator.manual_seed refuses (an overflow) ran, as its low bits; the bound is torch's
    own range, at the CLI, in Python and in a training run's --sample-seed; its ends are taken."""
    code, _, err = cli(*gen_args(snapshot, tmp_path / "x.png", "--seed", str(seed)))
    assert_one_line_error(code, err, f"seed must be a whole number in [{limits.MIN_SEED}, {limits.MAX_SEED}]")
    with pytest.raises(FluxKleinError, match=rf"seed must be a whole number in \[{limits.MIN_SEED}, "):
        RunSettings("a fox", seed=seed).check()
    code, _, err = cli("train", "--model", snapshot, "--data", tmp_path, "--output", tmp_path / "o.safetensors",
                       "--sample-seed", str(seed), "--sample-prompt", "x")  # fmt: skip
    assert_one_line_error(code, err, "sample-seed must be a whole number in")
    for ok in (limits.MIN_SEED, limits.MAX_SEED):
        assert RunSettings("a fox", seed=ok).check()
    assert no_models == [] and not (tmp_path / "x.png").exists()
