"""Each family's text encoder equals its reference, written once for both families (issue 45): FLUX.2 [klein]'s
Qwen3 against transformers' Qwen3ForCausalLM hidden_states[9, 18, 27], FLUX 3 Image Klein's Qwen3-VL text tower
(8 taps, a window of 80s a prompt) against diffusers' `Flux3TextEncoderStep` (tests/support/text_encoders.py:
the tiny encoders, their judges, prompts and tolerances). Then Qwen3's configs and the loader's refusals."""

import dataclasses
import json
import warnings

import mlx.core as mx
import numpy as np
import pytest
import torch
from families import KITS
from mlx.utils import tree_flatten
from refs import config_snapshot, load_one, rel_err, to_np
from text_encoders import Qwen3Texts, check_tokens, shared_text_snapshot
from transformers import Qwen3Config as HFQwen3Config
from transformers import Qwen3ForCausalLM

import flux_klein_mlx.run.components as components
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.family import FAMILIES
from flux_klein_mlx.models.config import Qwen3Config
from flux_klein_mlx.models.flux2.config import FluxKleinParams, qwen3_4b, qwen3_8b
from flux_klein_mlx.models.text_encoder import Qwen3TextEncoder, encode_prompts, sanitize_qwen3_weights
from flux_klein_mlx.models.tokenizer import PromptTokenizer
from flux_klein_mlx.run.loading import describe

CASES = [(f, v, c) for f in sorted(KITS) for v, c in KITS[f].text.cases]
VARIANTS = [(f, v) for f in sorted(KITS) for v in KITS[f].text.variants]


@pytest.mark.parametrize("name, variant, case", CASES, ids=["-".join(c) for c in CASES])
def test_matches_reference(tmp_path_factory, name, variant, case):
    texts, family = KITS[name].text, FAMILIES[name]
    snapshot = shared_text_snapshot(tmp_path_factory, name, variant)
    assert (snapshot.folder / "model.safetensors.index.json").is_file()  # sharded
    prompts, length = texts.prompts[case]
    batch = 1 if isinstance(prompts, str) else len(prompts)
    encoder = load_one("text_encoder", snapshot.root, dtype=mx.float32, family=family)
    tok = PromptTokenizer.from_folder(snapshot.root)  # FLUX 3: text_encoder/ and its chat_template.json
    theirs, seen = snapshot.reference(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long prompt's truncation warning (test_tokenizer checks it)
        check_tokens(tok.tokens(prompts, family.text_window), seen, length)
        ours = encode_prompts(encoder, tok, prompts, family.text_window)
    pad = family.text_window.pad_position
    if pad is not None:  # pad rows exist here, at the window's pad position
        n = int(seen["attention_mask"].sum())
        assert n < length and (seen["position_ids"][0, n:] == pad).all()
    assert ours.shape == (batch, length, len(family.text_taps) * texts.hidden) and ours.dtype == mx.float32
    assert np.isfinite(to_np(ours)).all()  # nothing of the poisoned layers, norm, lm_head or vision tower
    err = rel_err(ours, theirs)
    assert err <= texts.tolerance, f"{case}: rel_err {err:.2e}"


def test_bfloat16_within_bound(family, tmp_path_factory):
    # bf16 weights (cast at load) and activations, measured against the reference's float32 run: FLUX.2 (27
    # layers deep) ours 4.4e-2, transformers' own bf16 run 4.3e-2; FLUX 3 (32 layers, relative to the largest
    # value) ours 3.3e-2, diffusers' own bf16 run 7.0e-2. bf16 has 8 mantissa bits.
    variant, case = family.text.bf16_case
    snapshot = shared_text_snapshot(tmp_path_factory, family.name, variant)
    window = FAMILIES[family.name].text_window
    encoder = load_one("text_encoder", snapshot.folder, dtype=mx.bfloat16, family=FAMILIES[family.name])
    tok = PromptTokenizer.from_folder(snapshot.root)
    prompts, _ = family.text.prompts[case]
    ours = encode_prompts(encoder, tok, prompts, window)
    assert ours.dtype == mx.bfloat16
    (theirs, _), (theirs16, _) = (snapshot.reference(prompts, dtype=d) for d in (torch.float32, torch.bfloat16))
    err, their_err = rel_err(ours, theirs), rel_err(theirs16.float(), theirs)
    assert err <= 1e-1 and err <= 2 * their_err, f"bf16 rel_err {err:.2e} (the reference's bf16: {their_err:.2e})"


@pytest.mark.parametrize("name, variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_unused_weights_never_read(tmp_path_factory, monkeypatch, name, variant):
    """The key filter runs on the lazy dict, before anything is evaluated: the layers past the deepest tap, the
    final norm, the lm_head (and FLUX 3's vision tower) never leave the file."""
    texts = KITS[name].text
    snapshot = shared_text_snapshot(tmp_path_factory, name, variant)
    kept = []
    real_read = components.read_weight_files

    def spy(files, keep=None):
        weights = real_read(files, keep=keep)
        kept.extend(weights)
        return weights

    monkeypatch.setattr(components, "read_weight_files", spy)
    encoder = load_one("text_encoder", snapshot.root, dtype=mx.float32, family=FAMILIES[name])
    assert kept and not [k for k in kept if texts.never_read(k)]
    assert texts.unread_parts <= {texts.never_read(k) for k in snapshot.model.state_dict()}  # the file holds them
    assert len(encoder.model.layers) == texts.layers_read
    params = sorted(k for k, _ in tree_flatten(encoder.parameters()))
    assert sorted(sanitize_qwen3_weights(dict.fromkeys(kept), texts.layers_read)) == params


# --- Qwen3's configs and the loader's refusals ---------------------------------------------------------------


def test_sanitize_leaves_nothing_over():
    """Every key of a real-layout checkpoint either maps onto a module parameter or is dropped."""
    for tie in (True, False):
        hf = Qwen3ForCausalLM(Qwen3Texts.config(tie))
        keys = list(hf.state_dict())
        assert any(".layers.27." in k for k in keys) and "model.norm.weight" in keys
        weights = {k: mx.zeros((1,)) for k in keys}
        ours = Qwen3TextEncoder(Qwen3Config.from_dict(hf.config.to_dict()))
        expected = {k for k, _ in tree_flatten(ours.parameters())}
        assert set(sanitize_qwen3_weights(weights)) == expected
        # A bare Qwen3Model checkpoint (no "model." prefix) maps the same way.
        bare = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
        assert set(sanitize_qwen3_weights(bare)) == expected


def test_config_from_transformers_configs():
    real = dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    )
    d = HFQwen3Config(**real).to_dict()  # transformers 5: rope_theta under rope_parameters
    assert "rope_theta" not in d and d["rope_parameters"]["rope_theta"] == 1e6
    assert Qwen3Config.from_dict(d) == qwen3_4b()
    # Older layout: top-level rope_theta, rope_scaling null, plus unknown keys.
    old = dict(real, rope_scaling=None, architectures=["Qwen3ForCausalLM"], torch_dtype="bfloat16")
    assert Qwen3Config.from_dict(old) == qwen3_4b()
    eight = dict(real, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
    assert Qwen3Config.from_dict(HFQwen3Config(**eight).to_dict()) == qwen3_8b()
    with pytest.raises(FluxKleinError, match="yarn"):
        Qwen3Config.from_dict(dict(real, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(FluxKleinError, match="hidden_size"):
        Qwen3Config.from_dict({"model_type": "qwen3"})


def test_missing_files_are_named(tmp_path):
    transformer = {
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": 96,
        "in_channels": 128,
    }
    config_snapshot(tmp_path, transformer, None)
    with pytest.raises(FluxKleinError, match="text_encoder") as e:
        describe(tmp_path)
    assert str(tmp_path) in str(e.value)
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    with pytest.raises(FluxKleinError, match="config.json") as e:
        describe(tmp_path)
    assert str(folder) in str(e.value)
    (folder / "config.json").write_text(json.dumps(Qwen3Texts.config(True).to_dict()))
    with pytest.raises(FluxKleinError, match="no .safetensors") as e:
        load_one("text_encoder", tmp_path)
    assert str(folder) in str(e.value)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FluxKleinError, match="model-00001-of-00002.safetensors"):
        load_one("text_encoder", tmp_path)


def test_hidden_size_mismatch_names_both(tmp_path):
    transformer = dataclasses.asdict(FluxKleinParams.klein_4b())
    config_snapshot(tmp_path, transformer, qwen3_8b().__dict__)  # configs only: refused before any weight
    with pytest.raises(FluxKleinError) as e:
        describe(tmp_path)
    msg = str(e.value)
    for part in ("4096", "12288", "7680", "joint_attention_dim", "Qwen3-8B", "klein-4B"):
        assert part in msg, msg


def test_out_layers_must_exist():
    with pytest.raises(FluxKleinError, match="1..36"):
        Qwen3TextEncoder(qwen3_4b(), out_layers=(9, 18, 37))
