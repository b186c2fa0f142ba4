"""A tiny random FLUX.2 [klein] snapshot in the exact Hugging Face layout (shared test fixture).

`make_tiny_snapshot` builds diffusers' own `Flux2KleinPipeline` from tiny random components and
`save_pretrained`s it, so the folder is laid out like black-forest-labs/FLUX.2-klein-4B:

    model_index.json          _class_name Flux2KleinPipeline, is_distilled (absent for Base)
    scheduler/scheduler_config.json
    transformer/config.json + diffusion_pytorch_model.safetensors
    text_encoder/config.json + model-0000{1,2}-of-00002.safetensors + index (sharded like the real repo)
    tokenizer/                the real Qwen3 tokenizer files
    vae/config.json + diffusion_pytorch_model.safetensors

Sizes are chosen so that quantization has something to do at group size 64 (transformer hidden 64,
Qwen3 o_proj/down_proj input 64) and something to skip (Qwen3 hidden 32, latent channels 32).
`write_bfl_transformer` adds the BFL single-file transformer (`flux-2-klein-4b.safetensors`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from refs import qwen_tokenizer_dir, randomize_

# Shared tiny sizes: transformer joint_attention_dim = 3 x Qwen3 hidden (layers 9, 18, 27 stacked).
QWEN_HIDDEN = 32
QWEN_LAYERS = 28  # >= 27 so indices (9, 18, 27) exist; layer 28 must be dropped by the loader
LATENT_CHANNELS = 8  # transformer in_channels = 4 x latent channels (2x2 patchify)
TRANSFORMER = dict(
    patch_size=1,
    in_channels=4 * LATENT_CHANNELS,
    out_channels=None,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=3 * QWEN_HIDDEN,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(8, 8, 8, 8),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
QWEN = dict(
    vocab_size=151936,  # the real tokenizer's ids must be in range
    hidden_size=QWEN_HIDDEN,
    intermediate_size=64,
    num_hidden_layers=QWEN_LAYERS,
    num_attention_heads=2,  # 2 query heads on 1 key-value head: grouped-query attention at the least
    num_key_value_heads=1,
    head_dim=16,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(16, 16, 32, 32),
    layers_per_block=1,
    act_fn="silu",
    latent_channels=LATENT_CHANNELS,
    norm_num_groups=8,
    sample_size=64,
    use_quant_conv=True,
    use_post_quant_conv=True,
    mid_block_add_attention=True,
    batch_norm_eps=1e-4,
    batch_norm_momentum=0.1,
    patch_size=(2, 2),
)
SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)


def make_tiny_components(seed: int = 0):
    """The tiny random reference modules (float32, eval mode): transformer, text encoder, VAE."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    transformer = randomize_(Flux2Transformer2DModel(**TRANSFORMER), seed).eval()
    text_encoder = randomize_(Qwen3ForCausalLM(Qwen3Config(**QWEN)), seed + 1).eval()
    vae = randomize_(AutoencoderKLFlux2(**VAE), seed + 2).eval()
    return transformer, text_encoder, vae


def make_tiny_snapshot(
    path: str | Path, *, distilled: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Write a tiny random klein snapshot (diffusers layout) to `path` and return it.

    `distilled=False` gives a Base-style repo (no `is_distilled` key in model_index.json).
    `dtype=torch.bfloat16` stores the weights in bf16 like the hub does; float32 (the default)
    keeps parity tests exact. The same `seed` always gives the same weights.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import AutoTokenizer

    path = Path(path)
    transformer, text_encoder, vae = make_tiny_components(seed)
    if dtype != torch.float32:
        transformer, text_encoder, vae = (m.to(dtype) for m in (transformer, text_encoder, vae))
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=AutoTokenizer.from_pretrained(qwen_tokenizer_dir()),
        transformer=transformer,
        is_distilled=distilled,
    )
    # A small shard size splits the text encoder into 2 shards + index, like the real repo.
    pipe.save_pretrained(path, safe_serialization=True, max_shard_size="12MB")

    index = json.loads((path / "model_index.json").read_text())
    if not distilled:
        index.pop("is_distilled", None)  # Base repos do not carry the key at all
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path


_SHARED: dict[tuple, Path] = {}


def shared_tiny_snapshot(tmp_path_factory, *, distilled: bool = True, seed: int = 0) -> Path:
    """`make_tiny_snapshot` built once per test session (per arguments); treat it as read-only."""
    key = (distilled, seed)
    if key not in _SHARED:
        name = f"tiny-klein-{'distilled' if distilled else 'base'}-{seed}"
        _SHARED[key] = make_tiny_snapshot(tmp_path_factory.mktemp(name) / "snapshot", distilled=distilled, seed=seed)
    return _SHARED[key]


# diffusers -> BFL names for the transformer (inverse of reference-spec 3.3).
_BFL_SIMPLE = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}


def diffusers_to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a diffusers Flux2 transformer state dict to the BFL single-file format."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        mod, _, leaf = k.rpartition(".")
        if mod in _BFL_SIMPLE:
            out[f"{_BFL_SIMPLE[mod]}.{leaf}"] = v
        elif mod == "norm_out.linear":  # diffusers [scale; shift] -> BFL [shift; scale]
            scale, shift = v.chunk(2, dim=0)
            out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale], 0)
    for k in sd:
        parts = k.split(".")
        if parts[0] == "transformer_blocks":
            i, rest = parts[1], ".".join(parts[2:])
            b = f"double_blocks.{i}"
            simple = {
                "attn.to_out.0.weight": "img_attn.proj.weight",
                "attn.to_add_out.weight": "txt_attn.proj.weight",
                "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
                "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
                "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
                "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
                "ff.linear_in.weight": "img_mlp.0.weight",
                "ff.linear_out.weight": "img_mlp.2.weight",
                "ff_context.linear_in.weight": "txt_mlp.0.weight",
                "ff_context.linear_out.weight": "txt_mlp.2.weight",
            }
            if rest in simple:
                out[f"{b}.{simple[rest]}"] = sd[k]
            elif rest == "attn.to_q.weight":
                p = f"transformer_blocks.{i}.attn."
                out[f"{b}.img_attn.qkv.weight"] = torch.cat([sd[p + f"to_{x}.weight"] for x in "qkv"], 0)
                out[f"{b}.txt_attn.qkv.weight"] = torch.cat([sd[p + f"add_{x}_proj.weight"] for x in "qkv"], 0)
        elif parts[0] == "single_transformer_blocks":
            i, rest = parts[1], ".".join(parts[2:])
            simple = {
                "attn.to_qkv_mlp_proj.weight": "linear1.weight",
                "attn.to_out.weight": "linear2.weight",
                "attn.norm_q.weight": "norm.query_norm.scale",
                "attn.norm_k.weight": "norm.key_norm.scale",
            }
            out[f"single_blocks.{i}.{simple[rest]}"] = sd[k]
    return out


def write_bfl_transformer(snapshot: str | Path, name: str = "flux-2-klein-4b.safetensors") -> Path:
    """Write the snapshot's transformer as a BFL single file at the snapshot root; return its path."""
    return write_bfl_file(snapshot, Path(snapshot) / name)


def write_bfl_file(snapshot: str | Path, path: str | Path, *, prefix: str = "") -> Path:
    """Write the snapshot's transformer as a BFL single file at `path`, every key with `prefix` (ComfyUI's
    files: "model.diffusion_model."); return `path`. (tiny_flux3.write_bfl_flux3_file is FLUX 3's.)"""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file

    model = Flux2Transformer2DModel.from_pretrained(Path(snapshot) / "transformer")
    sd = {prefix + k: v.contiguous() for k, v in diffusers_to_bfl(model.state_dict()).items()}
    save_file(sd, str(path))
    return Path(path)
