"""The FLUX 3 text-encoder tokenizer stand-in for diffusers' reference (shared test fixture).

diffusers' `Flux3TextEncoderStep` takes an `AutoProcessor` (Qwen3-VL's `Qwen3VLProcessor`), but that
processor needs torchvision for its video half, which the venv lacks. The step calls only two things
on it: `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` and `.tokenizer(...)`.
`Qwen3VLProcessorShim` offers exactly those, around the real Qwen3 tokenizer (the same ids as Qwen3-VL's).

`QWEN3_VL_TEMPLATE` is a Qwen3-VL-Instruct-style chat template for text-only messages: one
`<|im_start|>role\\n...<|im_end|>\\n` turn per message, then `<|im_start|>assistant\\n`, and no think block
(Qwen3's own template adds `<think>\\n\\n</think>\\n\\n` under `enable_thinking=False`; the Instruct VL
template has none). Unverified against the real `text_encoder/chat_template` of the gated FLUX 3 repos:
the FLUX 3 model notes (flux3.md, section 2.2) give this as the expected rendering.
"""

from __future__ import annotations

from pathlib import Path

# Text-only turns; a list content (Qwen3-VL's [{"type": "text", "text": ...}]) has its text parts joined.
QWEN3_VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Qwen3VLProcessorShim:
    """The two methods of `Qwen3VLProcessor` that diffusers' FLUX 3 text step uses.

    `tokenizer`: a Hugging Face Qwen3 tokenizer, which keeps its own chat template (a snapshot's
    `text_encoder/chat_template.jinja`); or a folder of tokenizer files, or None for the real Qwen3
    tokenizer files (`refs.qwen_tokenizer_dir`): both with `QWEN3_VL_TEMPLATE` installed.
    """

    def __init__(self, tokenizer=None):
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            from refs import qwen_tokenizer_dir
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or qwen_tokenizer_dir()))
            tokenizer.chat_template = QWEN3_VL_TEMPLATE
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = False, **kwargs):
        return self.tokenizer.apply_chat_template(
            messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
        )
