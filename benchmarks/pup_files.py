"""The released prompt upsampler's hub files without its weights (black-forest-labs/flux-3-image-klein-pup:
Qwen3.5-9B and its vision tower): config.json, tokenizer, chat template and image processor, for
upsample_memory.py, which writes random weights beside them. The tokenizer is Qwen3's (Qwen3.5's is gated)."""

from __future__ import annotations

import json
from pathlib import Path

from common import qwen_tokenizer_dir

# The released upsampler's shapes: Qwen3.5-9B (hidden 4096, 32 layers: 24 gated-DeltaNet + 8 attention, untied
# 248320-token embeddings) and its vision tower (27 layers of width 1152, merged 2x2 into 4096).
PUP_TEXT = dict(
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    full_attention_interval=4,
    max_position_embeddings=262144,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=1e7,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
        partial_rotary_factor=0.25,
    ),
)
PUP_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    out_hidden_size=4096,
    num_position_embeddings=2304,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
PUP_CHAT_TEMPLATE = (  # tests/support/tiny_pup.py's Qwen3.5 layout (the benchmarks import nothing from tests/)
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
PUP_IMAGE_PROCESSOR = dict(  # Qwen3.5's: 16 px patches merged 2x2, mean/std 0.5
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)


def write_hub_files(folder: Path, text_layers: int | None, vision_depth: int | None) -> dict:
    """config.json (transformers' Qwen3_5Config, as the hub repo holds it), tokenizer, template, processor."""
    from transformers import AutoTokenizer, Qwen3_5Config
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|im_end|>")}
    text = dict(PUP_TEXT, eos_token_id=ids["<|im_end|>"])
    vision = dict(PUP_VISION)
    if text_layers:  # a shallower check of the machinery (`one --depth`)
        text["num_hidden_layers"] = text_layers
    if vision_depth:
        vision["depth"] = vision_depth
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    tokenizer.chat_template = PUP_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(PUP_CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(**PUP_IMAGE_PROCESSOR).save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())
