"""Prompt tokenization equals transformers' chat template + padding/truncation to 512."""

import shutil
import warnings

import mlx.core as mx
import numpy as np
import pytest
from refs import qwen_tokenizer_dir, reference_tokens
from transformers import AutoTokenizer

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.tokenizer import FLUX2_WINDOW, PromptTokenizer

LONG = " ".join(f"word{i} and a fox" for i in range(150))  # well over 512 tokens
PROMPTS = [
    ["a red fox in the snow"],
    [LONG],
    [""],
    ["Ein Fuchs im Schnee, 雪の中の狐 🦊"],
    ["a cat", "a lighthouse on a cliff at dusk, oil painting, dramatic sky, crashing waves"],
]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("snapshot")
    shutil.copytree(qwen_tokenizer_dir(), root / "tokenizer")
    return root


@pytest.fixture(scope="module")
def ours(snapshot):
    return PromptTokenizer.from_folder(snapshot)


@pytest.fixture(scope="module")
def hf(snapshot):
    return AutoTokenizer.from_pretrained(snapshot / "tokenizer")


def reference(hf, prompts):
    """diffusers' `_get_qwen3_prompt_embeds` tokenization, prompt by prompt."""
    ids, masks = reference_tokens(hf, prompts)
    return np.array(ids), np.array(masks)


@pytest.mark.parametrize("prompts", PROMPTS, ids=["short", "long", "empty", "non_ascii", "batch"])
def test_matches_transformers(ours, hf, prompts):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids, mask = ours(prompts)
    assert len([w for w in caught if "dropped" in str(w.message)]) == (prompts == [LONG])  # only when truncated
    ref_ids, ref_mask = reference(hf, prompts)
    assert ids.dtype == mx.int32 and mask.dtype == mx.int32
    assert ids.shape == mask.shape == (len(prompts), 512)
    np.testing.assert_array_equal(np.array(ids), ref_ids)
    np.testing.assert_array_equal(np.array(mask), ref_mask)


def test_single_string_is_a_batch_of_one(ours):
    a, ma = ours("a red fox")
    b, mb = ours(["a red fox"])
    assert a.shape == (1, 512) and (a == b).all() and (ma == mb).all()


def test_template_text(ours):
    # Spec 5.2: one user turn, no system prompt, an empty think block after the assistant header.
    assert (
        ours.format("P", FLUX2_WINDOW)
        == "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_empty_prompt_has_12_real_tokens(ours):
    ids, mask = ours("")
    ids, mask = np.array(ids)[0], np.array(mask)[0]
    assert mask.sum() == 12 and (mask[:12] == 1).all()
    # im_start user \n im_end \n im_start assistant \n <think> \n\n </think> \n\n, then <|endoftext|>
    assert ids[:12].tolist() == [151644, 872, 198, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]
    assert (ids[12:] == 151643).all()


def test_long_prompt_warns_with_dropped_count(ours, hf):
    n = len(hf(ours.format(LONG, FLUX2_WINDOW))["input_ids"])
    assert n > 512
    expected = rf"prompt is {n} tokens; the last {n - 512} were dropped \(the model reads 512\)"
    with pytest.warns(UserWarning, match=expected):
        _, mask = ours(LONG)
    assert np.array(mask).all()


def test_text_the_tokenizer_cannot_encode_is_one_clear_error(ours):
    """A lone surrogate (an undecodable argv byte under surrogateescape, or a JSON `\\ud800`) is refused by
    name, not passed to the Rust tokenizer (whose TypeError says nothing); the fast tokenizer does fail on it."""
    with pytest.raises(TypeError):
        ours.hf_tokenizer(ours.format("caf\udce9", FLUX2_WINDOW))
    with pytest.raises(
        FluxKleinError,
        match=r"the prompt is not valid text: character 4 is a lone surrogate U\+DCE9 "
        r"\(byte 0xE9 that is not UTF-8",
    ):
        ours("caf\udce9")
    with pytest.raises(FluxKleinError, match=r"prompt 1 is not valid text: character 3 is a lone surrogate U\+D800; "):
        ours(["ok", "a \ud800"])


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(FluxKleinError, match="tokenizer") as e:
        PromptTokenizer.from_folder(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    shutil.copy(qwen_tokenizer_dir() / "tokenizer.json", folder)
    with pytest.raises(FluxKleinError, match="tokenizer_config.json") as e:
        PromptTokenizer.from_folder(tmp_path)
    assert str(folder) in str(e.value)
    (folder / "tokenizer.json").unlink()
    shutil.copy(qwen_tokenizer_dir() / "tokenizer_config.json", folder)
    with pytest.raises(FluxKleinError, match="tokenizer.json"):
        PromptTokenizer.from_folder(folder)
