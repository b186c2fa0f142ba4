"""The prompt upsampler against diffusers' `prompt_upsampler.py` (0.42.1): the request, the images the
model sees, the box rules, and the caption itself, token for token (greedy), on a tiny random Qwen3.5."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("mlx_vlm")

from diffusers.modular_pipelines.flux3 import prompt_upsampler as ref  # noqa: E402
from tiny_pup import processors_built_once, pup_reference, shared_tiny_pup  # noqa: E402

from flux_klein_mlx.errors import FluxKleinError  # noqa: E402
from flux_klein_mlx.upsample import boxes as ours_boxes  # noqa: E402
from flux_klein_mlx.upsample.prompts import EDIT_SCAFFOLDS, SYSTEM_PROMPTS  # noqa: E402
from flux_klein_mlx.upsample.request import build_request, reference_size, shown_reference  # noqa: E402
from flux_klein_mlx.upsample.runtime import PREFILL_CHUNK, Upsampler  # noqa: E402

NEW_TOKENS = 24  # enough to differ anywhere; the tiny model never stops on its own


def picture(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


@pytest.fixture(scope="module")
def pup(tmp_path_factory):
    return shared_tiny_pup(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(pup):
    return pup_reference(pup)


@pytest.fixture(scope="module", autouse=True)
def one_processor_per_folder():
    yield from processors_built_once()  # the upsampler's processor, built once for this module's loads (one a case)


def test_the_words_are_diffusers():
    assert SYSTEM_PROMPTS == ref.SYSTEM_PROMPTS
    assert EDIT_SCAFFOLDS == ref.I2I_SCAFFOLD


@pytest.mark.parametrize("count", [1, 2, 3, 10])
@pytest.mark.parametrize("size", [(640, 480), (2000, 1500), (33, 4000), (4000, 33), (31, 31), (1024, 1024)])
def test_reference_sizes_equal_diffusers(size, count):
    assert reference_size(*size, count) == ref.get_reference_size(*size, count)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_images_the_model_sees_equal_diffusers(count):
    images = [picture(700 + 37 * i, 500 - 11 * i, i, "RGBA" if i == 1 else "RGB") for i in range(count)]
    theirs = ref.prepare_references(images)
    ours = [shown_reference(im, count) for im in images]
    for a, b in zip(ours, theirs, strict=True):
        assert a.size == b.size and a.mode == b.mode == "RGB"
        assert np.array_equal(np.asarray(a), np.asarray(b))  # the same pixels after JPEG q92


def test_box_rules_equal_diffusers():
    user = [{"bbox": [0.5, 0.1, 0.95, 0.45], "desc": "a cat"}, {"id": "dog_1", "bbox": [0.4, 0.55, 0.95, 0.95]}]
    checked = ours_boxes.check_boxes(user, upsample=True)  # dog_1 has no desc: the upsampler writes it
    locked = ours_boxes.canvas_rows(checked)
    assert locked == ref.boxes_to_canvas(user)
    assert ours_boxes.layout_request("a cat and a dog", locked) == ref.format_layout_request("a cat and a dog", locked)
    answers = [
        'A cat <cat_9> and a dog <dog_1> and a ball <ball_1>. [{"id": "cat_9", "bbox": [500, 100, 950, 452], '
        '"desc": "A tabby."}, {"id": "dog_1", "bbox": [1, 2, 3, 4], "desc": " A collie. "}, '
        '{"id": "ball_1", "bbox": [10, 10, 90, 90], "desc": "A red ball."}, {"id": "bad", "bbox": [0, 0, 1, 1], '
        '"desc": "x"}, {"id": "vase_1", "from": "target", "src_bbox": null, "tgt_bbox": [5, 5, 50, 50], "desc": "v"}]',
        "no table at all",
        'broken [1, 2 then [{"id": "obj_1", "bbox": [1, 1, 2, 2], "desc": "?"}]',
    ]
    for answer in answers:
        assert ours_boxes.reconcile(answer, json.loads(json.dumps(locked))) == ref.reconcile_boxes(
            answer, json.loads(json.dumps(locked))
        )
        assert ours_boxes.split_answer(answer) == ref.split_caption(answer)


CASES = {
    "t2i": dict(prompt="a red fox in the snow", images=0, boxes=None),
    "i2i_one": dict(prompt="make it night", images=1, boxes=None),
    "i2i_three": dict(prompt="put the cat from the second image on the sofa of the first", images=3, boxes=None),
    "t2i_bbox": dict(prompt="a cat and a dog", images=0, boxes=[{"bbox": [0.5, 0.1, 0.95, 0.45], "desc": "cat"}]),
    "i2i_bbox": dict(
        prompt="add a vase",
        images=1,
        boxes=[{"id": "vase_1", "from": "target", "src_bbox": None, "tgt_bbox": [0.2, 0.6, 0.5, 0.8], "desc": "vase"}],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_caption_equals_diffusers_token_for_token(case, pup, reference):
    spec = CASES[case]
    images = [picture(300 + 50 * i, 220 + 30 * i, 10 + i) for i in range(spec["images"])]
    model, processor = reference
    kwargs = dict(images=ref.prepare_references(images)) if images else {}
    theirs = ref.upsample_prompt(
        model, processor, spec["prompt"], boxes=spec["boxes"], max_new_tokens=NEW_TOKENS, **kwargs
    )
    request = build_request(spec["prompt"], images, spec["boxes"])
    assert request.mode == case.removesuffix("_one").removesuffix("_three")
    progress = []
    with Upsampler(pup, max_new_tokens=NEW_TOKENS) as up:
        ours = up.caption(request, progress.append)
        ids = up.answer_ids(request)
        assert up.model is not None
    assert up.model is None  # released on leaving the block
    assert ours == theirs
    assert len(ids) == NEW_TOKENS and progress[-1].tokens == NEW_TOKENS
    # the token ids themselves: diffusers' greedy generate on the same request
    import torch

    shown = iter(kwargs.get("images") or [])
    messages = [
        {
            "role": m["role"],
            "content": [dict(p, image=next(shown)) if p["type"] == "image" else p for p in m["content"]],
        }
        for m in request.messages()
    ]
    inputs = processor.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        enable_thinking=False,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, inputs["input_ids"].shape[1] :].tolist() == ids
    # our prefill runs in passes of PREFILL_CHUNK tokens (memory) and diffusers' in one: a prompt longer than a
    # pass (the system prompts are) compares the chunked prefill itself
    assert inputs["input_ids"].shape[1] > PREFILL_CHUNK


@pytest.mark.parametrize(
    "boxes, words",
    [
        (["1.2,0,1,1:cat"], "outside the image"),
        (["0.5,0,0.2,1:cat"], "x0 < x1"),
        (["0,0.6,1,0.6:cat"], "y0 < y1"),
        (["0,0,1:cat"], "x0,y0,x1,y1:desc"),
        ([{"bbox": [0, 0, 1, 1], "descr": "a cat"}], "unknown key 'descr'"),  # no desc: the upsampler writes it
        ([{"bbox": [0, 0, 1, 1], "id": "1x"}], "id must be"),
        ([{"desc": "x"}], "no bbox"),
    ],
)
def test_a_bad_box_is_one_line(boxes, words):
    with pytest.raises(FluxKleinError, match=words) as e:
        build_request("a cat", [], boxes)
    assert "\n" not in str(e.value)


def test_more_than_ten_references_is_one_line():
    with pytest.raises(FluxKleinError, match="at most 10 reference images, not 11"):
        build_request("a cat", [picture(64, 64, i) for i in range(11)])
