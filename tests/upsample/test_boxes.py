"""Layout boxes: one parser (upsample/boxes.check_boxes) for every door, its rules and its bounds (issue 46).

What the CLI refused, Python and the server took: no desc, an unknown key, duplicate ids, an edit's forms in
a text-to-image run, a box narrower than the layout's 1/1000 grid. 5,000 boxes or a megabyte of box text
passed the prompt's limit and were tokenized. Each is one line now, through the CLI (`--box`), Python
(`boxes=`) and the server (`boxes`, tests/serve/test_serve.py), before any model loads; and the parser,
fed anything (a CLI string, any JSON), either gives valid boxes or one FluxKleinError line.
"""

from __future__ import annotations

import json
import re

import pytest
from command_line import assert_one_line_error, gen_args
from hypothesis import given, settings
from hypothesis import strategies as st

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.limits import MAX_BOXES, MAX_PROMPT_CHARS
from flux_klein_mlx.run.pipeline import load
from flux_klein_mlx.upsample.boxes import CANVAS, canvas_rows, check_boxes, parse_box

BOX = {"bbox": [0.1, 0.2, 0.6, 0.9], "desc": "a fox"}
BAD = [
    ([{"bbox": [0, 0, 1, 1]}], {}, "box 1 names no element"),
    ([{"bbox": [0, 0, 1, 1], "desc": " "}], {}, "box 1 names no element"),
    ([{**BOX, "descr": "x"}], {}, "box 1 has an unknown key 'descr'"),
    ([{**BOX, "id": "obj_2"}, BOX], {}, "box 2's id 'obj_2' is taken by an earlier box"),
    ([{**BOX, "id": "fox"}, {**BOX, "id": "fox"}], {}, "box 2's id 'fox' is taken"),
    ([{"from": "ref_image_99", "src_bbox": [0, 0, 1, 1], "desc": "x"}], {"references": 0}, "this run has none"),
    ([{"from": "target", "tgt_bbox": [0, 0, 1, 1], "desc": "x"}], {"references": 0}, "this run has none"),
    ([{"from": "ref_image_1", "src_bbox": [0, 0, 1, 1], "desc": "x"}], {"references": 1}, "ref_image_0 to ref_image_0"),
    ([{"from": "target", "src_bbox": [0, 0, 1, 1], "desc": "x"}], {"references": 1}, "has no src_bbox"),
    ([{**BOX, "from": "target"}], {}, "gives both bbox and"),
    ([{"bbox": [0.1, 0.1, 0.1004, 0.9], "desc": "x"}], {}, "narrower than the layout's grid"),
    ([{"bbox": [0.5, 0.2, 0.9, 0.2004], "desc": "x"}], {}, "each side must span at least 1/1000"),
    (["0,0,1,1:\udce9"], {}, "box 1's desc is not valid text"),
    ([BOX] * (MAX_BOXES + 1), {}, f"{MAX_BOXES + 1} layout boxes given (boxes=); the limit is {MAX_BOXES}"),
    ([{**BOX, "desc": "x" * 1_000_000}], {}, f"the limit for them together is {MAX_PROMPT_CHARS:,}"),
    ([{**BOX, "desc": "x" * 20_000}], {"prompt": "y" * 12_001}, "32,001 characters"),  # the prompt counts
]


@pytest.mark.parametrize("boxes, kw, words", BAD, ids=[w for *_, w in BAD])
def test_a_bad_box_is_one_line(boxes, kw, words):
    with pytest.raises(FluxKleinError, match=re.escape(words)) as e:
        check_boxes(boxes, **kw)
    assert "\n" not in str(e.value)


def test_the_bounds_are_checked_before_the_boxes_are_read():
    """5,000 boxes are refused by their count; their contents (here broken) are never read."""
    with pytest.raises(FluxKleinError, match="5,000 layout boxes given"):
        check_boxes([object()] * 5000)


def test_what_is_right_still_parses():
    both = check_boxes(
        [BOX, {"id": "dog_1", "bbox": [0.4, 0.55, 0.95, 0.95]}], upsample=True
    )  # the upsampler writes dog_1
    assert [b.get("id") for b in both] == [None, "dog_1"] and both[1]["desc"] == ""
    edit = {"id": "vase_1", "from": "target", "src_bbox": None, "tgt_bbox": [0.2, 0.6, 0.5, 0.8], "desc": "a vase"}
    moved = {"from": "ref_image_1", "src_bbox": [0, 0, 0.5, 0.5], "tgt_bbox": [0.5, 0.5, 1, 1], "desc": "the cat"}
    assert len(check_boxes([edit, moved], references=2)) == 2
    assert check_boxes([{"bbox": [0.1, 0.1, 0.1015, 0.9], "desc": "a pole"}])  # 1.5/1000: one unit on the grid
    assert check_boxes([{**BOX, "desc": "x" * (MAX_PROMPT_CHARS - 5)}], "a fox")


def valid(boxes) -> None:
    """What check_boxes gives: diffusers' dicts, distinct ids, each box at least one unit of the canvas."""
    rows = canvas_rows(boxes)
    assert len({row["id"] for row in rows}) == len(rows) <= MAX_BOXES
    for row in rows:
        for key in ("bbox", "src_bbox", "tgt_bbox"):
            if row.get(key) is not None:
                y0, x0, y1, x1 = row[key]
                assert 0 <= y0 < y1 <= CANVAS and 0 <= x0 < x1 <= CANVAS


def one_line_or_valid(boxes, **kw) -> None:
    try:
        checked = check_boxes(boxes, **kw)
    except FluxKleinError as e:
        assert str(e) and "\n" not in str(e)
        return
    valid(checked)


NUMBER = st.one_of(st.floats(allow_nan=True), st.integers(-3, 3), st.sampled_from([0, 0.0004, 0.5, 0.9996, 1]))
SPEC = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda xs, desc: ",".join(str(x) for x in xs) + desc,
        st.lists(NUMBER, min_size=3, max_size=5),
        st.one_of(st.just(""), st.text(max_size=10).map(lambda t: ":" + t)),
    ),
)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBER | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
BOX_DICT = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.sampled_from(["obj_1", "obj_2", "fox", "1x"]), JSON),
        "desc": st.one_of(st.text(max_size=10), JSON),
        "bbox": st.one_of(st.lists(NUMBER, min_size=4, max_size=4), JSON),
        "from": st.one_of(st.sampled_from(["target", "ref_image_0", "ref_image_3"]), JSON),
        "src_bbox": st.one_of(st.none(), st.lists(NUMBER, min_size=4, max_size=4)),
        "tgt_bbox": st.one_of(st.none(), st.lists(NUMBER, min_size=4, max_size=4)),
        "descr": st.text(max_size=3),
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(SPEC, max_size=4), st.booleans())
def test_any_box_string_parses_or_is_one_line(specs, upsample):
    one_line_or_valid(specs, upsample=upsample)
    for spec in specs:
        try:
            parse_box(spec)
        except FluxKleinError as e:
            assert "\n" not in str(e)


@settings(max_examples=300, deadline=None)
@given(st.one_of(JSON, st.lists(st.one_of(BOX_DICT, SPEC, JSON), max_size=4)), st.sampled_from([None, 0, 2]))
def test_any_json_parses_or_is_one_line(boxes, references):
    one_line_or_valid(json.loads(json.dumps(boxes)) if boxes is not None else None, references=references)


# --- the doors -------------------------------------------------------------------------------------------

DOORS = [
    ([f"0.1,0.1,0.5,0.5:fox {i}" for i in range(5000)], "5,000 layout boxes given"),
    (["0.1,0.1,0.5,0.5:" + "x" * 40_000], "the limit for them together is 32,000"),
    (["0.1,0.1,0.5,0.5"], "box 1 names no element"),
    (["0.1,0.1,0.1004,0.5:a pole"], "narrower than the layout's grid"),
    (["0.1,0.1,0.5,0.5:caf\udce9"], "box 1's desc is not valid text"),  # argv bytes not UTF-8 (surrogateescape)
]


@pytest.mark.parametrize("boxes, words", DOORS, ids=[w for _, w in DOORS])
def test_the_cli_and_python_refuse_alike_before_any_model(cli, base, tmp_path, no_models, boxes, words):
    args = [arg for box in boxes for arg in ("--box", box)]
    code, _, err = cli(*gen_args(base, tmp_path / "a.png", *args))
    assert_one_line_error(code, err, words)
    with pytest.raises(FluxKleinError, match=re.escape(words)):
        load(base).generate("a fox", boxes=boxes)
    with pytest.raises(FluxKleinError, match=re.escape(words)):
        load(base).generate("a fox", boxes=[parse_box(box) for box in boxes])
    assert list(tmp_path.iterdir()) == []
