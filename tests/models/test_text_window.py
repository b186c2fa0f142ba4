"""FLUX 3 Image Klein's text window, what FLUX.2's fixed 512 has not: diffusers' `Flux3TextEncoderStep` defaults
(a window of 80s a prompt, taps 4..32), a window capped by max_length, the pads' RoPE position 1, the Qwen3-VL
chat template read from text_encoder/, one prompt a window. The tiny Qwen3-VL tower and its judge are
tests/support/text_encoders.py's (the parity of every prompt is tests/models/test_text_encoder.py's)."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from flux3_text import QWEN3_VL_TEMPLATE
from refs import load_one, rel_err, to_np
from text_encoders import check_tokens, shared_text_snapshot

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.family import FLUX3
from flux_klein_mlx.models.config import Qwen3Config
from flux_klein_mlx.models.text_encoder import FLUX3_TAPS, encode_prompts
from flux_klein_mlx.models.tokenizer import FLUX3_WINDOW, PromptTokenizer, TextWindow, chat_template_source
from flux_klein_mlx.storage.weights import read_json

SHORT = "a red fox in the snow"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return shared_text_snapshot(tmp_path_factory, "flux3", "vl")


def load_ours(snapshot):
    return load_one("text_encoder", snapshot.root, dtype=mx.float32, family=FLUX3)


def test_constants_are_diffusers_defaults():
    step = Flux3TextEncoderStep()
    defaults = {p.name: p.default for p in step.inputs}
    assert FLUX3_WINDOW == TextWindow(defaults["max_sequence_length"], step.pad_multiple, 1, thinking_off=False)
    assert FLUX3_TAPS == tuple(defaults["text_encoder_out_layers"])
    assert FLUX3.text_window == FLUX3_WINDOW and FLUX3.text_taps == FLUX3_TAPS


def test_max_length_cap(snapshot):
    """A window capped by max_length: 100 tokens (not a multiple of 80), the prompt cut from the right."""
    prompt = " ".join(f"fox{i}" for i in range(60))  # over 100 tokens
    window = TextWindow(100, multiple=80, pad_position=1, thinking_off=False)
    tok = PromptTokenizer.from_folder(snapshot.root)
    theirs, seen = snapshot.reference(prompt, max_length=100)
    with pytest.warns(UserWarning, match="were dropped"):
        tokens = tok.tokens(prompt, window)
    check_tokens(tokens, seen, 100)
    assert int(seen["attention_mask"].sum()) == 100  # no pad: truncated to the cap
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = encode_prompts(load_ours(snapshot), tok, prompt, window)
    assert rel_err(ours, theirs) <= 1e-5


def test_pad_positions_matter(snapshot):
    """The pads' position 1 is what makes the pad rows equal: at 0..L-1 they move, the real rows do not."""
    tok = PromptTokenizer.from_folder(snapshot.root)
    encoder = load_ours(snapshot)
    tokens = tok.tokens(SHORT, FLUX3_WINDOW)
    n = int(np.array(tokens.mask).sum())
    at_one = to_np(encoder(tokens.ids, tokens.mask, tokens.positions))
    default = to_np(encoder(tokens.ids, tokens.mask))  # mlx-lm's own RoPE, positions 0..L-1
    explicit = to_np(encoder(tokens.ids, tokens.mask, mx.arange(80)[None]))  # our RoPE, the same positions
    assert np.abs(default - explicit).max() <= 1e-5  # the two RoPE paths agree
    assert np.abs(at_one[:, :n] - default[:, :n]).max() <= 1e-5  # causal: real rows never see pads
    assert np.abs(at_one[:, n:] - default[:, n:]).max() > 1e-2


def test_config_and_template(snapshot):
    config = Qwen3Config.from_dict(read_json(snapshot.folder / "config.json"))
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (16, 33, 8)
    assert (config.num_attention_heads, config.num_key_value_heads, config.rope_theta) == (2, 1, 5e6)
    tok = PromptTokenizer.from_folder(snapshot.root)
    assert tok.format("P", FLUX3_WINDOW) == "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n"
    assert chat_template_source(snapshot.root) == QWEN3_VL_TEMPLATE
    with pytest.raises(FluxKleinError, match="one at a time"):
        tok.tokens(["a", "b"], FLUX3_WINDOW)
