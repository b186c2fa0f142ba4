"""Prompt tokenization for the Qwen3 text encoder: chat template, right padding to the model's window.

FLUX.2 [klein] (BFL `Qwen3Embedder` and diffusers `Flux2KleinPipeline`) puts each prompt in a
single user turn of the Qwen3 chat template with thinking disabled, which inserts an empty think
block: `<|im_start|>user\\nP<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.
The token ids are then right-padded with `<|endoftext|>` (or truncated from the right) to exactly
512; every one of the 512 positions reaches the transformer, pads included.

FLUX 3 Image Klein (diffusers `Flux3TextEncoderStep`) uses its Qwen3-VL checkpoint's own template
with no extra argument, pads each prompt to the next multiple of 80 tokens (at most 8192) and
gives the pads RoPE position 1. `TextWindow` holds such a rule as data; its tokenizer files sit in
`text_encoder/` (those repos have no `tokenizer/` folder).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from ..errors import FluxKleinError

MAX_LENGTH = 512


@dataclass(frozen=True)
class TextWindow:
    """How prompt tokens fill the text window the transformer reads (part of each model's recipe).

    max_length: the most tokens read (longer prompts are cut, with a warning). multiple: None, every
    window is max_length (FLUX.2: 512); else a prompt's length rounded up to it, capped at max_length
    (FLUX 3: 80, 8192), one prompt per window. pad_position: None, pads follow the real tokens
    (0..L-1); else every pad's RoPE position (FLUX 3: 1, as its training's transformers 4.57 gave).
    thinking_off: the template gets enable_thinking=False (FLUX.2); else no extra argument (FLUX 3).
    """

    max_length: int
    multiple: int | None = None
    pad_position: int | None = None
    thinking_off: bool = True

    def length(self, n: int) -> int:
        """The window's length for a prompt of n tokens (n <= max_length)."""
        if self.multiple is None:
            return self.max_length
        return min(-(-n // self.multiple) * self.multiple, self.max_length)


FLUX2_WINDOW = TextWindow(MAX_LENGTH)
FLUX3_WINDOW = TextWindow(8192, multiple=80, pad_position=1, thinking_off=False)


class Tokens(NamedTuple):
    """A tokenized window: every array int32 (B, L)."""

    ids: mx.array
    mask: mx.array  # 1 real token, 0 pad
    positions: mx.array  # the RoPE position of each token


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


def tokenizer_folder(folder: str | Path) -> Path:
    """The tokenizer files of a model snapshot: its `tokenizer/` folder (FLUX.2), else its `text_encoder/`
    folder when that holds them (FLUX 3), else `folder` itself (a tokenizer folder). Checked complete."""
    folder = Path(folder)
    if (folder / "tokenizer").is_dir():
        folder = folder / "tokenizer"
    elif (folder / "text_encoder" / "tokenizer_config.json").is_file():
        folder = folder / "text_encoder"
    if not folder.is_dir():
        raise FluxKleinError(
            f"missing tokenizer folder: looked for {folder}; point to a model snapshot that has a "
            "tokenizer/ folder (FLUX.2 [klein]) or the tokenizer files in text_encoder/ (FLUX 3)"
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


# The files of a tokenizer (and its chat template) by name: FLUX 3 keeps them in text_encoder/ beside the
# encoder's weights and configs, which a copy of "the tokenizer" must leave out.
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template")


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The tokenizer's own files in its folder (`tokenizer_folder`), sorted; never weights or model configs."""
    folder = tokenizer_folder(folder)
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(TOKENIZER_FILE_PREFIXES))


def _processor_template(folder: Path) -> str | None:
    """A processor's `chat_template.json` template ({"chat_template": "..."}, Qwen3-VL's file), which
    AutoTokenizer does not read; `chat_template.jinja`, which it does, wins."""
    path = folder / "chat_template.json"
    if (folder / "chat_template.jinja").is_file() or not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        raise FluxKleinError(
            f"{path} is not a chat template file (JSON with 'chat_template'); download it again"
        ) from None
    return template if isinstance(template, str) else None


class PromptTokenizer:
    """Turn prompts into the ids, mask and positions the Qwen3 text encoder reads.

    Wraps a Hugging Face (transformers) Qwen2/Qwen3 tokenizer; build it with `from_folder`.
    """

    def __init__(self, hf_tokenizer):
        self.hf_tokenizer = hf_tokenizer
        pad_id = hf_tokenizer.pad_token_id
        self.pad_token_id = int(hf_tokenizer.convert_tokens_to_ids("<|endoftext|>") if pad_id is None else pad_id)

    @classmethod
    def from_folder(cls, folder: str | Path) -> PromptTokenizer:
        """Load from a model snapshot (its `tokenizer/` folder, else `text_encoder/`) or a tokenizer folder."""
        folder = tokenizer_folder(folder)
        # transformers is a dependency of mlx-lm; imported here so importing us stays cheap.
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:
            raise FluxKleinError(
                f"could not load the tokenizer in {folder} ({str(e).splitlines()[0][:160]}); download it again"
            ) from None
        template = _processor_template(folder)
        if template is not None:
            tok.chat_template = template  # what the checkpoint's processor (diffusers' tokenizer) applies
        if not getattr(tok, "chat_template", None):
            raise FluxKleinError(
                f"the tokenizer in {folder} has no chat template (tokenizer_config.json, "
                "chat_template.jinja or chat_template.json); the model needs its checkpoint's one"
            )
        return cls(tok)

    def format(self, prompt: str, window: TextWindow) -> str:
        """The chat-template text for one prompt: one user turn (FLUX.2's window: thinking disabled)."""
        extra = {"enable_thinking": False} if window.thinking_off else {}
        return self.hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, **extra
        )

    def _prompt_ids(self, prompt, label: str, window: TextWindow) -> list[int]:
        if not isinstance(prompt, str):
            raise FluxKleinError(f"{label} is a {type(prompt).__name__}, not text")
        check_text(prompt, label)
        ids = list(self.hf_tokenizer(self.format(prompt, window))["input_ids"])
        if len(ids) > window.max_length:
            warnings.warn(
                f"{label} is {len(ids)} tokens; the last {len(ids) - window.max_length} were dropped "
                f"(the model reads {window.max_length})",
                stacklevel=3,
            )
        return ids[: window.max_length]

    def tokens(self, prompts: str | list[str], window: TextWindow) -> Tokens:
        """Tokenize prompts into one window each, right-padded: `Tokens`, every array int32 (B, L).

        L is `window.length` of the prompt (512 for FLUX.2). Prompts longer than `window.max_length`
        tokens (template included) are cut from the right, with a warning that says how many tokens
        were dropped. A window sized per prompt (`window.multiple`) takes one prompt.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) == 0:
            raise FluxKleinError("no prompt given: pass at least one prompt (an empty string is a valid prompt)")
        if window.multiple is not None and len(prompts) > 1:
            raise FluxKleinError(
                f"{len(prompts)} prompts given, but this model sizes the text window per prompt: encode one at a time"
            )
        labels = [f"prompt {i}" for i in range(len(prompts))] if len(prompts) > 1 else ["the prompt"]
        rows = []
        for prompt, label in zip(prompts, labels, strict=True):
            rows.append(self._prompt_ids(prompt, label, window))
        L = window.length(max(len(r) for r in rows))
        ids = [r + [self.pad_token_id] * (L - len(r)) for r in rows]
        mask = [[1] * len(r) + [0] * (L - len(r)) for r in rows]
        if window.pad_position is None:
            positions = [list(range(L)) for _ in rows]
        else:
            positions = [list(range(len(r))) + [window.pad_position] * (L - len(r)) for r in rows]
        return Tokens(*(mx.array(a, dtype=mx.int32) for a in (ids, mask, positions)))

    def __call__(self, prompts: str | list[str], max_length: int = MAX_LENGTH) -> tuple[mx.array, mx.array]:
        """FLUX.2's tokenization: input_ids and attention_mask, both int32 (B, max_length)."""
        tokens = self.tokens(prompts, TextWindow(max_length))
        return tokens.ids, tokens.mask


def chat_template_source(folder: str | Path) -> str:
    """The chat template as the tokenizer folder stores it (`chat_template.jinja`, which
    transformers prefers, else a processor's chat_template.json, else tokenizer_config.json's
    "chat_template"), read without building the tokenizer (which costs ~0.7 s): what a
    prompt-cache key needs on a hit."""
    folder = tokenizer_folder(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _processor_template(folder)
    if template is not None:
        return template
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if template is None:
        raise FluxKleinError(f"the tokenizer in {folder} has no chat template; the model needs its checkpoint's one")
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def load_tokenizer(folder: str | Path) -> PromptTokenizer:
    """Load the prompt tokenizer of a model snapshot (or of a tokenizer folder)."""
    return PromptTokenizer.from_folder(folder)
