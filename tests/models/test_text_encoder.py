"""Qwen3 text encoder parity with transformers' Qwen3ForCausalLM hidden_states[9, 18, 27]."""

import dataclasses
import json
import shutil
import warnings

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from refs import config_snapshot, load_one, qwen_tokenizer_dir, randomize_, reference_tokens, rel_err, to_np
from transformers import AutoTokenizer, Qwen3ForCausalLM
from transformers import Qwen3Config as HFQwen3Config

import flux_klein_mlx.run.components as components
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.config import Qwen3Config
from flux_klein_mlx.models.flux2.config import FluxKleinParams, qwen3_4b, qwen3_8b
from flux_klein_mlx.models.text_encoder import Qwen3TextEncoder, encode_prompts, sanitize_qwen3_weights
from flux_klein_mlx.models.tokenizer import FLUX2_WINDOW, PromptTokenizer
from flux_klein_mlx.run.loading import describe

PROMPTS = {
    "short": ["a red fox in the snow"],
    "long": [" ".join(f"word{i} and a fox" for i in range(150))],  # well over 512 tokens
    "empty": [""],
    "non_ascii": ["Ein Fuchs im Schnee, 雪の中の狐 🦊"],
    "batch": ["a cat", "a lighthouse on a cliff at dusk, oil painting, dramatic sky, crashing waves"],
}
LAYERS = (9, 18, 27)


def tiny_hf_config(tie: bool, attn: str = "sdpa") -> HFQwen3Config:
    # 28 layers: layer 28 (0-based 27) exists in the checkpoint and must be skipped. The real
    # vocabulary, so the real tokenizer's ids index the embedding.
    return HFQwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        max_position_embeddings=1024,
        attn_implementation=attn,
    )


def build_snapshot(root, tie: bool, attn: str, seed: int) -> Qwen3ForCausalLM:
    """A random tiny Qwen3ForCausalLM saved (sharded) as `root/text_encoder`, plus `root/tokenizer`.

    Everything the encoder must not read (layer 28, the final norm, an untied lm_head) is NaN:
    if any of it reached our output, the output would not be finite.
    """
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_hf_config(tie, attn)).eval()
    rope = {n: b.clone() for n, b in model.named_buffers()}
    randomize_(model, seed)
    with torch.no_grad():
        for n, b in model.named_buffers():  # RoPE frequencies are not weights: keep them
            b.copy_(rope[n])
        for p in model.model.layers[27].parameters():
            p.fill_(float("nan"))
        model.model.norm.weight.fill_(float("nan"))
        if not tie:
            model.lm_head.weight.fill_(float("nan"))
    model.save_pretrained(root / "text_encoder", max_shard_size="4MB")
    shutil.copytree(qwen_tokenizer_dir(), root / "tokenizer")
    return model


def reference_embeddings(model, tok, prompts):
    """transformers end to end: chat template, pad/truncate to 512, hidden_states 9/18/27."""
    ids, masks = reference_tokens(tok, prompts)
    with torch.no_grad():
        out = model.model(  # the trunk: hidden_states are the same, the 151936-wide logits skipped
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(masks),
            output_hidden_states=True,
            use_cache=False,
        )
    return torch.cat([out.hidden_states[i] for i in LAYERS], dim=-1)


class Snapshot:
    """A saved tiny checkpoint, its reference model, and both tokenizers, loaded once."""

    def __init__(self, root, tie, attn, seed):
        self.root, self.tie = root, tie
        self.model = build_snapshot(root, tie, attn, seed)
        self.hf_tok = AutoTokenizer.from_pretrained(root / "tokenizer")
        self.tok = PromptTokenizer.from_folder(root)
        self._refs = {}

    def reference(self, prompts):
        key = tuple(prompts)
        if key not in self._refs:
            self._refs[key] = reference_embeddings(self.model, self.hf_tok, prompts)
        return self._refs[key]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return Snapshot(tmp_path_factory.mktemp("tied"), tie=True, attn="sdpa", seed=1)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    # Untied embeddings (as Qwen3-8B) and transformers' eager attention as a second reference.
    return Snapshot(tmp_path_factory.mktemp("untied"), tie=False, attn="eager", seed=2)


@pytest.mark.parametrize(
    "which, case",
    [("tied", c) for c in PROMPTS] + [("untied", "long"), ("untied", "batch")],  # the hardest two, for time
)
def test_matches_transformers(request, which, case):
    snapshot = request.getfixturevalue(which)
    root = snapshot.root
    assert (root / "text_encoder" / "model.safetensors.index.json").is_file()  # sharded
    prompts = PROMPTS[case]
    encoder = load_one("text_encoder", root, dtype=mx.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long prompt's truncation warning (test_tokenizer checks it)
        ours = encode_prompts(encoder, snapshot.tok, prompts, FLUX2_WINDOW)
    theirs = snapshot.reference(prompts)
    assert ours.shape == (len(prompts), 512, 96) and ours.dtype == mx.float32
    assert np.isfinite(to_np(ours)).all()  # nothing of the poisoned layer 28 / norm / lm_head
    err = rel_err(ours, theirs)
    assert err <= 1e-4, f"{case}: rel_err {err:.2e}"


def test_bfloat16_close_to_float32_reference(tied):
    # The bf16 path (weights cast at load, bool mask). On this model transformers' own bf16 run
    # is 4.3e-2 away from its float32 run, ours 4.4e-2: bf16 has 8 mantissa bits, 27 layers deep.
    snapshot = tied
    encoder = load_one("text_encoder", snapshot.root / "text_encoder", dtype=mx.bfloat16)
    ours = encode_prompts(encoder, snapshot.tok, PROMPTS["batch"], FLUX2_WINDOW)
    assert ours.dtype == mx.bfloat16
    err = rel_err(ours, snapshot.reference(PROMPTS["batch"]))
    assert err <= 1e-1, f"bf16 rel_err {err:.2e}"


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_unused_weights_never_read(request, which, monkeypatch):
    """The key filter runs on the lazy dict, before anything is evaluated: layer 28, the final
    norm and the lm_head never leave the file."""
    root = request.getfixturevalue(which).root
    kept = []
    real_read = components.read_weight_files

    def spy(files, keep=None):
        weights = real_read(files, keep=keep)
        kept.extend(weights)
        return weights

    monkeypatch.setattr(components, "read_weight_files", spy)
    encoder = load_one("text_encoder", root, dtype=mx.float32)
    assert kept and not [k for k in kept if ".layers.27." in k]
    assert not [k for k in kept if k.startswith("lm_head") or k == "model.norm.weight"]
    assert len(encoder.model.layers) == 27
    assert sorted(kept) == sorted(k for k, _ in tree_flatten(encoder.parameters()))


def test_sanitize_leaves_nothing_over():
    """Every key of a real-layout checkpoint either maps onto a module parameter or is dropped."""
    for tie in (True, False):
        hf = Qwen3ForCausalLM(tiny_hf_config(tie))
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
    (folder / "config.json").write_text(json.dumps(tiny_hf_config(True).to_dict()))
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
