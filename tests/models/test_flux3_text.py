"""FLUX 3's Qwen3-VL text tower equals diffusers' `Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds`.

A tiny random `Qwen3VLForConditionalGeneration` (text hidden 16, interleaved MRoPE, a 1-layer vision
tower) saved with `save_pretrained`, its tokenizer files and chat_template.json in text_encoder/ as
FLUX 3's repos have them. Ours reads it through the loading pieces (`read_weight_files` with the key
filter, `sanitize_qwen3_weights`, the strict `load_into`) and tokenizes with `FLUX3_WINDOW`.

The tower has 33 layers, not 32: transformers replaces the last entry of `hidden_states` by the final
norm's output, so with exactly 32 layers diffusers' tap 32 would be normed, which the real 36-layer
Qwen3-VL-4B never sees. Layer 33, the final norm, the lm_head and the vision tower are NaN: had any
reached our output, it would not be finite.
"""

import copy
import json
import shutil
import warnings
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from flux3_text import QWEN3_VL_TEMPLATE, Qwen3VLProcessorShim
from mlx.utils import tree_flatten
from refs import qwen_tokenizer_dir, randomize_, rel_err, to_np
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.config import Qwen3Config
from flux_klein_mlx.models.text_encoder import (
    FLUX3_TAPS,
    Qwen3TextEncoder,
    encode_prompts,
    keeps_key,
    sanitize_qwen3_weights,
)
from flux_klein_mlx.models.tokenizer import FLUX3_WINDOW, PromptTokenizer, TextWindow, chat_template_source
from flux_klein_mlx.storage.weights import component_files, load_into, read_json, read_weight_files

HIDDEN, LAYERS = 16, 33
SHORT = "a red fox in the snow"
OVER_80 = " ".join(f"fox{i}" for i in range(40))  # 80 < tokens <= 160 with the template
PROMPTS = {"short": (SHORT, 80), "over_80": (OVER_80, 160), "empty": ("", 80)}


def tiny_config() -> Qwen3VLConfig:
    text = dict(
        vocab_size=151936,  # the real vocabulary, so the real tokenizer's ids index the embedding
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=HIDDEN,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux3_text")
    torch.manual_seed(0)
    model = randomize_(Qwen3VLForConditionalGeneration(tiny_config()).eval(), seed=3)
    with torch.no_grad():
        never = [model.model.language_model.layers[LAYERS - 1], model.model.language_model.norm]
        for module in never + [model.model.visual, model.lm_head]:
            for p in module.parameters():
                p.fill_(float("nan"))
    folder = root / "text_encoder"
    model.save_pretrained(folder, max_shard_size="4MB")
    for f in qwen_tokenizer_dir().iterdir():  # no tokenizer/ folder: the files sit in text_encoder/
        shutil.copy(f, folder)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN3_VL_TEMPLATE}))
    return SimpleNamespace(root=root, folder=folder, model=model, processor=Qwen3VLProcessorShim(folder))


def load_ours(folder, dtype=mx.float32, seen=None):
    """config -> module -> read (filtered) -> sanitize -> strict load, as the loader's pieces do."""
    encoder = Qwen3TextEncoder(Qwen3Config.from_dict(read_json(folder / "config.json")), FLUX3_TAPS)
    deepest = max(FLUX3_TAPS)

    def keep(key):
        kept = keeps_key(key, deepest)
        if kept and seen is not None:
            seen.append(key)
        return kept

    weights = sanitize_qwen3_weights(read_weight_files(component_files(folder), keep=keep), deepest)
    load_into(encoder, weights, "text encoder", dtype=dtype)
    mx.eval(encoder.parameters())
    return encoder


def reference(model, processor, prompt, max_length=8192):
    """diffusers' embeddings, and the ids, mask and positions it handed the model."""
    seen = {}

    def spy(module, args, kwargs):
        seen.update({k: kwargs[k].numpy() for k in ("input_ids", "attention_mask", "position_ids")})

    handle = model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        with torch.no_grad():
            embeds = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
                model, processor, prompt, max_sequence_length=max_length
            )
    finally:
        handle.remove()
    return embeds, seen


def check_tokens(tokens, seen, length):
    assert tokens.ids.shape == tokens.mask.shape == tokens.positions.shape == (1, length)
    np.testing.assert_array_equal(np.array(tokens.ids), seen["input_ids"])
    np.testing.assert_array_equal(np.array(tokens.mask), seen["attention_mask"])
    np.testing.assert_array_equal(np.array(tokens.positions), seen["position_ids"])


def test_constants_are_diffusers_defaults():
    step = Flux3TextEncoderStep()
    defaults = {p.name: p.default for p in step.inputs}
    assert FLUX3_WINDOW == TextWindow(defaults["max_sequence_length"], step.pad_multiple, 1, thinking_off=False)
    assert FLUX3_TAPS == tuple(defaults["text_encoder_out_layers"])


@pytest.mark.parametrize("case", list(PROMPTS))
def test_matches_diffusers(snapshot, case):
    prompt, length = PROMPTS[case]
    tok = PromptTokenizer.from_folder(snapshot.root)  # finds text_encoder/ and its chat_template.json
    encoder = load_ours(snapshot.folder)
    theirs, seen = reference(snapshot.model, snapshot.processor, prompt)
    tokens = tok.tokens(prompt, FLUX3_WINDOW)
    check_tokens(tokens, seen, length)
    n = int(seen["attention_mask"].sum())
    assert n < length and (seen["position_ids"][0, n:] == 1).all()  # pad rows exist, at position 1
    ours = encode_prompts(encoder, tok, prompt, FLUX3_WINDOW)
    assert ours.shape == (1, length, len(FLUX3_TAPS) * HIDDEN) and ours.dtype == mx.float32
    assert np.isfinite(to_np(ours)).all()  # nothing of layer 33, the norm, lm_head or the vision tower
    # measured (pad rows included): rel_err 1.1e-6 / 3.4e-6 / 8.2e-7 (max |diff| 2.0e-5 / 5.1e-5 / 1.1e-5 on
    # values up to 18): float32 rounding, growing with depth from 2e-6 at tap 4 to 5e-5 at tap 32
    err = rel_err(ours, theirs)
    assert err <= 1e-5, f"{case}: rel_err {err:.2e}"


def test_max_length_cap(snapshot):
    """A window capped by max_length: 100 tokens (not a multiple of 80), the prompt cut from the right."""
    prompt = " ".join(f"fox{i}" for i in range(60))  # over 100 tokens
    window = TextWindow(100, multiple=80, pad_position=1, thinking_off=False)
    tok = PromptTokenizer.from_folder(snapshot.root)
    theirs, seen = reference(snapshot.model, snapshot.processor, prompt, max_length=100)
    with pytest.warns(UserWarning, match="were dropped"):
        tokens = tok.tokens(prompt, window)
    check_tokens(tokens, seen, 100)
    assert int(seen["attention_mask"].sum()) == 100  # no pad: truncated to the cap
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = encode_prompts(load_ours(snapshot.folder), tok, prompt, window)
    assert rel_err(ours, theirs) <= 1e-5


def test_pad_positions_matter(snapshot):
    """The pads' position 1 is what makes the pad rows equal: at 0..L-1 they move, the real rows do not."""
    tok = PromptTokenizer.from_folder(snapshot.root)
    encoder = load_ours(snapshot.folder)
    tokens = tok.tokens(SHORT, FLUX3_WINDOW)
    n = int(np.array(tokens.mask).sum())
    at_one = to_np(encoder(tokens.ids, tokens.mask, tokens.positions))
    default = to_np(encoder(tokens.ids, tokens.mask))  # mlx-lm's own RoPE, positions 0..L-1
    explicit = to_np(encoder(tokens.ids, tokens.mask, mx.arange(80)[None]))  # our RoPE, the same positions
    assert np.abs(default - explicit).max() <= 1e-5  # the two RoPE paths agree
    assert np.abs(at_one[:, :n] - default[:, :n]).max() <= 1e-5  # causal: real rows never see pads
    assert np.abs(at_one[:, n:] - default[:, n:]).max() > 1e-2


def test_bfloat16_within_bound(snapshot):
    # bf16 weights and activations, 32 layers deep (measured): ours vs diffusers' float32 run 3.3e-2
    # (relative to the largest value), diffusers' own bf16 run vs its float32 run 7.0e-2.
    tok = PromptTokenizer.from_folder(snapshot.root)
    ours = encode_prompts(load_ours(snapshot.folder, mx.bfloat16), tok, OVER_80, FLUX3_WINDOW)
    assert ours.dtype == mx.bfloat16
    theirs, _ = reference(snapshot.model, snapshot.processor, OVER_80)
    theirs_bf16, _ = reference(copy.deepcopy(snapshot.model).to(torch.bfloat16), snapshot.processor, OVER_80)
    err, their_err = rel_err(ours, theirs), rel_err(theirs_bf16.float(), theirs)
    assert err <= 1e-1 and err <= 2 * their_err, f"bf16 rel_err {err:.2e} (diffusers' bf16: {their_err:.2e})"


def test_only_the_language_tower_up_to_the_deepest_tap_is_read(snapshot):
    seen = []
    encoder = load_ours(snapshot.folder, seen=seen)
    assert len(encoder.model.layers) == 32
    assert seen and all(k.startswith("model.language_model.") for k in seen)  # no model.visual.*, no lm_head
    assert not [k for k in seen if ".layers.32." in k or k == "model.language_model.norm.weight"]
    every = list(snapshot.model.state_dict())
    assert any(k.startswith("model.visual.") for k in every) and "lm_head.weight" in every
    assert sorted(sanitize_qwen3_weights(dict.fromkeys(seen), 32)) == sorted(
        k for k, _ in tree_flatten(encoder.parameters())
    )


def test_config_and_template(snapshot):
    config = Qwen3Config.from_dict(read_json(snapshot.folder / "config.json"))
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (HIDDEN, LAYERS, 8)
    assert (config.num_attention_heads, config.num_key_value_heads, config.rope_theta) == (2, 1, 5e6)
    tok = PromptTokenizer.from_folder(snapshot.root)
    assert tok.format("P", FLUX3_WINDOW) == "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n"
    assert chat_template_source(snapshot.root) == QWEN3_VL_TEMPLATE
    with pytest.raises(FluxKleinError, match="one at a time"):
        tok.tokens(["a", "b"], FLUX3_WINDOW)
