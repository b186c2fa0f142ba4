"""Each family's tiny text encoder and its reference, for the text tests written once for both families
(tests/models/test_text_encoder.py, tests/models/test_text_window.py).

FLUX.2 [klein]: a random Qwen3ForCausalLM (hidden 32, 28 layers, the real vocabulary) saved sharded as
`text_encoder/` with the real tokenizer in `tokenizer/`; transformers end to end (chat template, thinking off,
padded / truncated to 512, `hidden_states[9, 18, 27]`) is the judge. Two variants: tied embeddings with sdpa,
and untied (as Qwen3-8B) with transformers' eager attention as a second reference.

FLUX 3 Image Klein: a random Qwen3VLForConditionalGeneration (text hidden 16, interleaved MRoPE, a 1-layer
vision tower) saved with its tokenizer files and chat_template.json in `text_encoder/`, as FLUX 3's repos have
them; diffusers' `Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds` is the judge. The tower has 33 layers, not
32: transformers replaces the last entry of `hidden_states` by the final norm's output, so with exactly 32
layers diffusers' tap 32 would be normed, which the real 36-layer Qwen3-VL-4B never sees.

Everything the encoder must not read (the layer past the deepest tap, the final norm, an untied lm_head, the
vision tower) is NaN: had any of it reached our output, the output would not be finite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from refs import qwen_tokenizer_dir, randomize_, reference_tokens

_SHARED: dict[tuple, TextSnapshot] = {}


class TextSnapshot:
    """A saved tiny text encoder (`root/text_encoder`), its reference module, and the reference's embeddings
    and token inputs, each computed once per prompts and dtype."""

    def __init__(self, root: Path, model, reference_run):
        self.root, self.folder, self.model = root, root / "text_encoder", model
        self._run, self._memo = reference_run, {}

    def reference(self, prompts, dtype=torch.float32, **kw):
        """(the reference's embeddings, {input_ids, attention_mask[, position_ids]: what it handed the model})."""
        key = (repr(prompts), dtype, repr(sorted(kw.items())))
        if key not in self._memo:
            model = self.model if dtype == torch.float32 else _cast(self.model, dtype)
            self._memo[key] = self._run(self, model, prompts, **kw)
        return self._memo[key]


def _cast(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype)


def _poison(modules) -> None:
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.fill_(float("nan"))


class Qwen3Texts:
    """FLUX.2 [klein]'s text encoder against transformers' Qwen3ForCausalLM."""

    variants = {"tied": dict(tie=True, attn="sdpa", seed=1), "untied": dict(tie=False, attn="eager", seed=2)}
    prompts = {  # case -> (prompts, window length)
        "short": (["a red fox in the snow"], 512),
        "long": ([" ".join(f"word{i} and a fox" for i in range(150))], 512),  # well over 512 tokens
        "empty": ([""], 512),
        "non_ascii": (["Ein Fuchs im Schnee, 雪の中の狐 🦊"], 512),
        "batch": (["a cat", "a lighthouse on a cliff at dusk, oil painting, dramatic sky, crashing waves"], 512),
    }
    cases = [("tied", c) for c in prompts] + [("untied", "long"), ("untied", "batch")]  # the hardest two, for time
    bf16_case = ("tied", "batch")
    hidden, layers_read = 32, 27
    tolerance = 1e-4  # float32 rel_err vs transformers

    @staticmethod
    def config(tie: bool = True, attn: str = "sdpa"):
        from transformers import Qwen3Config as HFQwen3Config

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

    unread_parts = {"layer 28", "final norm"}  # what every variant's checkpoint holds and the encoder never reads

    @staticmethod
    def never_read(key: str) -> str | None:
        """The part of the checkpoint `key` belongs to when the encoder must never read it, else None."""
        if ".layers.27." in key:
            return "layer 28"
        if key == "model.norm.weight":
            return "final norm"
        return "lm_head" if key.startswith("lm_head") else None

    def build(self, root: Path, variant: str) -> TextSnapshot:
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        v = self.variants[variant]
        torch.manual_seed(v["seed"])
        model = Qwen3ForCausalLM(self.config(v["tie"], v["attn"])).eval()
        rope = {n: b.clone() for n, b in model.named_buffers()}
        randomize_(model, v["seed"])
        with torch.no_grad():
            for n, b in model.named_buffers():  # RoPE frequencies are not weights: keep them
                b.copy_(rope[n])
            if not v["tie"]:
                model.lm_head.weight.fill_(float("nan"))
        _poison([model.model.layers[27], model.model.norm])
        model.save_pretrained(root / "text_encoder", max_shard_size="4MB")
        shutil.copytree(qwen_tokenizer_dir(), root / "tokenizer")
        hf_tok = AutoTokenizer.from_pretrained(root / "tokenizer")

        def run(snapshot, model, prompts):
            """transformers end to end: chat template, pad/truncate to 512, hidden_states 9/18/27."""
            ids, masks = reference_tokens(hf_tok, prompts)
            with torch.no_grad():
                out = model.model(  # the trunk: hidden_states are the same, the 151936-wide logits skipped
                    input_ids=torch.tensor(ids),
                    attention_mask=torch.tensor(masks),
                    output_hidden_states=True,
                    use_cache=False,
                )
            embeds = torch.cat([out.hidden_states[i] for i in (9, 18, 27)], dim=-1)
            return embeds, {"input_ids": np.array(ids), "attention_mask": np.array(masks)}

        return TextSnapshot(root, model, run)


QWEN3_VL_TEXT = dict(
    vocab_size=151936,  # the real vocabulary, so the real tokenizer's ids index the embedding
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=33,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)


class Qwen3VLTexts:
    """FLUX 3 Image Klein's Qwen3-VL text tower against diffusers' `Flux3TextEncoderStep`."""

    variants = {"vl": {}}
    prompts = {  # case -> (prompt, window length): one prompt a window
        "short": ("a red fox in the snow", 80),
        "over_80": (" ".join(f"fox{i}" for i in range(40)), 160),  # 80 < tokens <= 160 with the template
        "empty": ("", 80),
    }
    cases = [("vl", c) for c in prompts]
    bf16_case = ("vl", "over_80")
    hidden, layers_read = 16, 32
    # measured (pad rows included): rel_err 1.1e-6 / 3.4e-6 / 8.2e-7 (max |diff| 2.0e-5 / 5.1e-5 / 1.1e-5 on
    # values up to 18): float32 rounding, growing with depth from 2e-6 at tap 4 to 5e-5 at tap 32
    tolerance = 1e-5

    @staticmethod
    def config():
        from transformers import Qwen3VLConfig

        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                      num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
        return Qwen3VLConfig(text_config=QWEN3_VL_TEXT, vision_config=vision, tie_word_embeddings=False)

    unread_parts = {"layer 33", "final norm", "lm_head", "vision tower"}

    @staticmethod
    def never_read(key: str) -> str | None:
        """The part of the checkpoint `key` belongs to when the encoder must never read it, else None."""
        if key.startswith("model.visual."):
            return "vision tower"
        if key.startswith("lm_head"):
            return "lm_head"
        inner = key.removeprefix("model.language_model.")
        if inner == key:
            return "outside the language tower"
        if inner.startswith("layers.32."):
            return "layer 33"
        return "final norm" if inner == "norm.weight" else None

    def build(self, root: Path, variant: str) -> TextSnapshot:
        from flux3_text import QWEN3_VL_TEMPLATE, Qwen3VLProcessorShim
        from transformers import Qwen3VLForConditionalGeneration

        torch.manual_seed(0)
        model = randomize_(Qwen3VLForConditionalGeneration(self.config()).eval(), seed=3)
        tower = model.model.language_model
        _poison([tower.layers[32], tower.norm, model.model.visual, model.lm_head])
        folder = root / "text_encoder"
        model.save_pretrained(folder, max_shard_size="4MB")
        for f in qwen_tokenizer_dir().iterdir():  # no tokenizer/ folder: the files sit in text_encoder/
            shutil.copy(f, folder)
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN3_VL_TEMPLATE}))
        processor = Qwen3VLProcessorShim(folder)

        def run(snapshot, model, prompt, max_length=8192):
            """diffusers' embeddings, and the ids, mask and positions it handed the model."""
            from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

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

        return TextSnapshot(root, model, run)


def check_tokens(tokens, seen: dict, length: int) -> None:
    """Our tokens are the ones the reference handed its model (ids, mask, and positions where it gives them)."""
    batch = tokens.ids.shape[0]
    assert tokens.ids.shape == tokens.mask.shape == tokens.positions.shape == (batch, length)
    ours = {"input_ids": tokens.ids, "attention_mask": tokens.mask, "position_ids": tokens.positions}
    assert {"input_ids", "attention_mask"} <= seen.keys()
    for key, theirs in seen.items():
        np.testing.assert_array_equal(np.array(ours[key]), theirs)


TEXTS = {"flux2": Qwen3Texts(), "flux3": Qwen3VLTexts()}


def shared_text_snapshot(tmp_path_factory, family: str, variant: str) -> TextSnapshot:
    """The family's tiny text encoder `variant`, built once per test session; treat it as read-only."""
    key = (family, variant)
    if key not in _SHARED:
        _SHARED[key] = TEXTS[family].build(tmp_path_factory.mktemp(f"text-{family}-{variant}"), variant)
    return _SHARED[key]
