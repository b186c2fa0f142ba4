"""A tiny random FLUX 3 prompt upsampler (Qwen3.5 vision-language) and diffusers' processor for it.

`make_tiny_pup(folder)` writes a random `Qwen3_5ForConditionalGeneration` (transformers 5.24) as the
hub repo black-forest-labs/flux-3-image-klein-pup lays it out: config.json, generation_config.json,
model.safetensors, the real Qwen tokenizer files (`refs.qwen_tokenizer_dir`: its vision tokens
<|vision_start|> <|image_pad|> <|vision_end|> are the config's image ids), `chat_template.jinja`
(`QWEN3_5_TEMPLATE`) and preprocessor_config.json (Qwen2-VL's image processor settings of Qwen3.5:
16 px patches merged 2x2, mean/std 0.5).

`pup_processor(folder)` is the processor diffusers' upsampler step is given. Qwen3.5's processor class
is `Qwen3VLProcessor`, whose constructor checks a video processor class that needs torchvision (absent
here): `Qwen3VLProcessorNoVideo` skips that check and is built with the torchvision-free
`Qwen2VLImageProcessorPil` and no video processor. The upsampler step uses only its image and text
halves (apply_chat_template with images, decode).

Not verified (the repo is gated): the real chat template (ours: Qwen3.5's layout, images as
<|vision_start|><|image_pad|><|vision_end|>, `enable_thinking=False` adding an empty think block),
the real preprocessor_config.json and generation_config.json eos ids.

Sizes: text hidden 32, 4 layers (3 gated-DeltaNet, 1 attention: Qwen3.5's 3:1 pattern), vocab 151936
so every tokenizer id is in range; a 1-layer vision tower of width 16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from refs import qwen_tokenizer_dir, randomize_

QWEN3_5_TEMPLATE = (
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
IMAGE_PROCESSOR = dict(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)


def tiny_pup_config(tokenizer):
    from transformers import Qwen3_5Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|im_end|>")}
    text = dict(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=8192,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=1e7,
            mrope_section=[1, 1, 0],
            mrope_interleaved=True,
            partial_rotary_factor=0.25,
        ),
        eos_token_id=ids["<|im_end|>"],
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=1,
        out_hidden_size=32,
        num_position_embeddings=16,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def make_tiny_pup(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny upsampler folder (float32) to `folder`; the same seed gives the same weights."""
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    torch.manual_seed(seed)
    model = randomize_(Qwen3_5ForConditionalGeneration(tiny_pup_config(tokenizer)), seed).eval()
    model.save_pretrained(folder)
    tokenizer.chat_template = QWEN3_5_TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN3_5_TEMPLATE)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    return folder


_SHARED: dict[int, Path] = {}


def shared_tiny_pup(tmp_path_factory, seed: int = 0) -> Path:
    """`make_tiny_pup` once per test session; treat it as read-only."""
    if seed not in _SHARED:
        _SHARED[seed] = make_tiny_pup(tmp_path_factory.mktemp(f"tiny-pup-{seed}") / "pup", seed)
    return _SHARED[seed]


def pup_processor(folder: str | Path):
    """diffusers' `prompt_upsampler_processor` for the folder: Qwen3VLProcessor without its video half."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class Qwen3VLProcessorNoVideo(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # the video class check needs torchvision
            return None

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
    return Qwen3VLProcessorNoVideo(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=QWEN3_5_TEMPLATE
    )


def pup_reference(folder: str | Path):
    """(model, processor) of diffusers' upsampler step on the folder, float32 on the CPU."""
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(folder)).eval(), pup_processor(folder)


def quick_pup(folder: str | Path, tmp_path: str | Path) -> Path:
    """A copy of the tiny upsampler that stops after its first token: the random model opens every caption with
    the same token (the chat's end `<think>...</think>` decides it), made its eos id beside <|im_end|>, so each
    caption is that one token, decoded, and the doors' tests run in seconds. The weights are the same files (linked).
    """
    from flux_klein_mlx.upsample.request import build_request
    from flux_klein_mlx.upsample.runtime import Upsampler

    with Upsampler(folder, max_new_tokens=1) as up:
        first = up.answer_ids(build_request("a fox"))[0]
    quick = Path(tmp_path) / "quick-pup"
    quick.mkdir()
    for file in Path(folder).iterdir():
        if file.name != "generation_config.json":
            (quick / file.name).symlink_to(file.resolve())
    generation = json.loads((Path(folder) / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], first]
    (quick / "generation_config.json").write_text(json.dumps(generation))
    return quick


def processors_built_once():
    """A generator for a module fixture: while it runs, mlx-vlm's `load_processor` (which `Upsampler.load` reaches
    through `mlx_vlm.load`) builds each upsampler folder's processor once, keyed by the contents of its files but
    the weights: transformers parses the 11 MB tokenizer.json in Python twice a load (~1.3 s each, measured), and a
    test loads the same tiny upsampler again and again. The model itself loads every time, from its files; a folder
    changed or copied elsewhere, and every subprocess, runs the real loader. (tests/conftest.py does the same for
    the prompt tokenizer.)"""
    import hashlib

    import mlx_vlm.utils
    import pytest

    real = mlx_vlm.utils.load_processor
    built = {}

    def load_processor(model_path, add_detokenizer=True, eos_token_ids=None, **kwargs):
        files = sorted(p for p in Path(model_path).iterdir() if p.is_file() and p.suffix != ".safetensors")
        contents = tuple((p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in files)
        key = (str(model_path), contents, add_detokenizer, repr(eos_token_ids), repr(sorted(kwargs.items())))
        if key not in built:
            built[key] = real(model_path, add_detokenizer, eos_token_ids, **kwargs)
        return built[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(mlx_vlm.utils, "load_processor", load_processor)
    yield
    mp.undo()
