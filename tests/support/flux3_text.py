"""A stand-in for FLUX 3's Qwen3-VL processor, for reference runs of diffusers' FLUX 3 text step.

diffusers' `Flux3TextEncoderStep` takes an `AutoProcessor` (`Qwen3VLProcessor`) as its tokenizer and
calls two things of it: `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`
and `.tokenizer(text, ...)`. The real processor needs torchvision (for its video processor), which
this venv lacks, so the shim gives those two: the real Qwen3 tokenizer (tests/support/refs.
qwen_tokenizer_dir, the same vocabulary as Qwen3-VL) and a Qwen3-VL-Instruct-style template.

QWEN3_VL_TEMPLATE is written from what flux3.md section 2.2 says the Instruct template renders for a
text-only user turn, `<|im_start|>user\\nP<|im_end|>\\n<|im_start|>assistant\\n` (no think block, no
default system turn); it is not the checkpoint's file, which could not be read here.
"""

from __future__ import annotations

from pathlib import Path

from refs import qwen_tokenizer_dir

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

    `folder`: a folder with the tokenizer files (a snapshot's text_encoder/); default: the real
    Qwen3 tokenizer's. The template is always QWEN3_VL_TEMPLATE.
    """

    def __init__(self, folder: str | Path | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder or qwen_tokenizer_dir()))
        self.chat_template = QWEN3_VL_TEMPLATE

    def apply_chat_template(self, conversation, **kwargs):
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, **kwargs)
