"""Prompt tokenization for the Qwen3 text encoder: chat template, right padding to 512 tokens.

FLUX.2 [klein] (BFL `Qwen3Embedder` and diffusers `Flux2KleinPipeline`) puts each prompt in a
single user turn of the Qwen3 chat template with thinking disabled, which inserts an empty think
block: `<|im_start|>user\\nP<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.
The token ids are then right-padded with `<|endoftext|>` (or truncated from the right) to exactly
512; every one of the 512 positions reaches the transformer, pads included.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import mlx.core as mx

from ..errors import FluxKleinError

MAX_LENGTH = 512


def check_text(text: str, name: str = "the prompt") -> None:
    """Refuse text the tokenizer cannot encode: a lone UTF-16 surrogate (U+D800-U+DFFF), which is what
    Python makes of bytes that are not UTF-8 on the command line (surrogateescape: byte 0xE9 becomes
    U+DCE9) and what a JSON `\\ud800` escape gives. One rule for every door: an error, never a guess."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            code = ord(ch)
            byte = f" (byte 0x{code - 0xDC00:02X} that is not UTF-8, if it came from the command line)"
            byte = byte if code >= 0xDC80 else ""
            raise FluxKleinError(
                f"{name} is not valid text: character {i + 1} is a lone surrogate U+{code:04X}{byte}; "
                "write it in UTF-8 (check your terminal's or client's encoding)"
            )


def _tokenizer_folder(folder: str | Path) -> Path:
    """Accept a model snapshot (with a `tokenizer/` folder) or the tokenizer folder itself."""
    folder = Path(folder)
    if (folder / "tokenizer").is_dir():
        folder = folder / "tokenizer"
    if not folder.is_dir():
        raise FluxKleinError(
            f"missing tokenizer folder: looked for {folder}; point to a FLUX.2 [klein] snapshot "
            "that has a tokenizer/ folder"
        )
    present = {p.name for p in folder.iterdir() if p.is_file()}
    missing = []
    if "tokenizer.json" not in present and not {"vocab.json", "merges.txt"} <= present:
        missing.append("tokenizer.json (or vocab.json + merges.txt)")
    if "tokenizer_config.json" not in present:
        missing.append("tokenizer_config.json")
    if missing:
        raise FluxKleinError(
            f"the tokenizer in {folder} is incomplete: missing {' and '.join(missing)}; download the snapshot again"
        )
    return folder


class PromptTokenizer:
    """Turn prompts into the (input_ids, attention_mask) pair the Qwen3 text encoder reads.

    Wraps a Hugging Face (transformers) Qwen2/Qwen3 tokenizer; build it with `from_folder`.
    """

    def __init__(self, hf_tokenizer):
        self.hf_tokenizer = hf_tokenizer
        pad_id = hf_tokenizer.pad_token_id
        self.pad_token_id = int(hf_tokenizer.convert_tokens_to_ids("<|endoftext|>") if pad_id is None else pad_id)

    @classmethod
    def from_folder(cls, folder: str | Path) -> PromptTokenizer:
        """Load from a model snapshot (its `tokenizer/` folder) or a tokenizer folder."""
        folder = _tokenizer_folder(folder)
        # transformers is a dependency of mlx-lm; imported here so importing us stays cheap.
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:
            raise FluxKleinError(
                f"could not load the tokenizer in {folder} ({str(e).splitlines()[0][:160]}); download it again"
            ) from None
        if not getattr(tok, "chat_template", None):
            raise FluxKleinError(
                f"the tokenizer in {folder} has no chat template (tokenizer_config.json or "
                "chat_template.jinja); FLUX.2 [klein] needs the Qwen3 one"
            )
        return cls(tok)

    def format(self, prompt: str) -> str:
        """The chat-template text for one prompt (one user turn, thinking disabled)."""
        return self.hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )

    def __call__(self, prompts: str | list[str], max_length: int = MAX_LENGTH) -> tuple[mx.array, mx.array]:
        """Tokenize prompts: returns input_ids and attention_mask, both int32 (B, max_length).

        Prompts longer than `max_length` tokens (template included) are cut from the right,
        with a warning that says how many tokens were dropped.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) == 0:
            raise FluxKleinError("no prompt given: pass at least one prompt (an empty string is a valid prompt)")
        ids_rows, mask_rows = [], []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise FluxKleinError(f"prompt {i} is a {type(prompt).__name__}, not text")
            label = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            check_text(prompt, label)
            ids = list(self.hf_tokenizer(self.format(prompt))["input_ids"])
            if len(ids) > max_length:
                warnings.warn(
                    f"{label} is {len(ids)} tokens; the last {len(ids) - max_length} were dropped "
                    f"(the model reads {max_length})",
                    stacklevel=2,
                )
                ids = ids[:max_length]
            n = len(ids)
            ids_rows.append(ids + [self.pad_token_id] * (max_length - n))
            mask_rows.append([1] * n + [0] * (max_length - n))
        return mx.array(ids_rows, dtype=mx.int32), mx.array(mask_rows, dtype=mx.int32)


def chat_template_source(folder: str | Path) -> str:
    """The chat template as the tokenizer folder stores it (`chat_template.jinja`, which
    transformers prefers, else tokenizer_config.json's "chat_template"), read without building
    the tokenizer (which costs ~0.7 s): what a prompt-cache key needs on a hit."""
    folder = _tokenizer_folder(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if template is None:
        raise FluxKleinError(f"the tokenizer in {folder} has no chat template; FLUX.2 [klein] needs the Qwen3 one")
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def load_tokenizer(folder: str | Path) -> PromptTokenizer:
    """Load the prompt tokenizer of a model snapshot (or of a tokenizer folder)."""
    return PromptTokenizer.from_folder(folder)
