"""A tiny random FLUX 3 Image Klein snapshot in the Hugging Face hub layout (shared test fixture).

`make_tiny_flux3_snapshot` builds diffusers' own modular pipeline (`Flux3DistilledAutoBlocks` or
`Flux3AutoBlocks`, the prompt upsampler popped), gives it tiny random components with
`update_components` and lets `save_pretrained` write the folder. diffusers 0.42.1 writes:

    modular_model_index.json   _class_name Flux3DistilledModularPipeline / Flux3ModularPipeline,
                               _blocks_class_name Flux3DistilledAutoBlocks / Flux3AutoBlocks, and one
                               [library, class, loading spec] entry per from_pretrained component:
                               text_encoder, tokenizer, vae, transformer (no model_index.json)
    transformer/config.json + diffusion_pytorch_model.safetensors
    text_encoder/config.json + generation_config.json + model-0000{1,2}-of-00002.safetensors + index
    tokenizer/tokenizer.json + tokenizer_config.json + chat_template.jinja
    vae/config.json + diffusion_pytorch_model.safetensors

No scheduler/ and no guider/: both are `from_config` components, which the blocks build themselves
(`FlowMatchEulerDiscreteScheduler(shift=6.93)`, `ClassifierFreeGuidance(3.5)` on Base) and which
save_pretrained neither writes nor lists. Then the folder is arranged as the hub repos are (the FLUX 3
model notes, flux3.md section 3): the tokenizer files move into text_encoder/ (the repos have no
tokenizer/ folder; mflux reads `text_encoder/tokenizer*` and `text_encoder/chat_template.*`), and every loading
spec names the hub repo, as a `save_pretrained(push_to_hub=True)` writes it, with the tokenizer's
spec at subfolder text_encoder and the blocks' own type hint (transformers, AutoProcessor).
`SNAPSHOT_FILES` is the resulting file list.

Not verified (the repos are gated): the real modular_model_index.json (its tokenizer entry above is
inferred), whether the real chat template is `chat_template.jinja` or `.json` and its exact text
(ours: flux3_text.QWEN3_VL_TEMPLATE), the processor's preprocessor_config.json /
video_preprocessor_config.json (not written: Qwen3VLProcessor needs torchvision, and the text-only
path never reads them), vocab.json / merges.txt (transformers 5 writes tokenizer.json only), the
real text encoder's shard count and the BFL files `model.safetensors` / `ae.safetensors` at the root
(`write_bfl_flux3_file` writes the transformer one on demand).

Sizes: transformer D 64 (2 heads x 32) so quantization at group size 64 has work, in 32 (latent 8 x
2 x 2 patchify), 2 mode + 2 single blocks, joint_attention_dim 8 taps x Qwen hidden 16 = 128;
Qwen3-VL text hidden 16 with 33 layers (the taps 4..32 exist, and one past the deepest: transformers 5
returns the final norm's output as the last hidden state, so with 32 layers diffusers' tap 32 would be
normed, unlike the real 36-layer model's) and a 1-layer vision tower; the FLUX.2
tiny VAE of tiny_model.py (FLUX 3 reuses that VAE).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from flux3_text import QWEN3_VL_TEMPLATE
from refs import qwen_tokenizer_dir, randomize_
from tiny_model import LATENT_CHANNELS, VAE

FLUX3_QWEN_HIDDEN = 16
FLUX3_TRANSFORMER = dict(
    in_channels=4 * LATENT_CHANNELS,
    cond_in_channels=4 * LATENT_CHANNELS,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=8 * FLUX3_QWEN_HIDDEN,  # 8 taps (layers 4, 8, ..., 32) stacked per token
    timestep_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(8, 8, 8, 8),
    rope_theta=10000,
    eps=1e-6,
)
QWEN3_VL = dict(
    text_config=dict(
        vocab_size=151936,  # the real tokenizer's ids must be in range
        hidden_size=FLUX3_QWEN_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=33,  # one past the deepest tap (32): its raw state, as in the real 36-layer model
        num_attention_heads=2,  # grouped-query attention at the least: 2 query heads on 1 key-value head
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[2, 1, 1], mrope_interleaved=True),
    ),
    # A 1-layer tower so that the checkpoint carries model.visual.* keys, which the text path never reads.
    vision_config=dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=1,
        out_hidden_size=FLUX3_QWEN_HIDDEN,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    ),
    tie_word_embeddings=True,  # Qwen3-VL-4B ties lm_head to the embeddings (unverified for the FLUX 3 copy)
)
HUB_REPOS = {True: "black-forest-labs/flux-3-image-klein", False: "black-forest-labs/flux-3-image-klein-base"}
SNAPSHOT_FILES = (
    "modular_model_index.json",
    "text_encoder/chat_template.jinja",
    "text_encoder/config.json",
    "text_encoder/generation_config.json",
    "text_encoder/model-00001-of-00002.safetensors",
    "text_encoder/model-00002-of-00002.safetensors",
    "text_encoder/model.safetensors.index.json",
    "text_encoder/tokenizer.json",
    "text_encoder/tokenizer_config.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
)


def make_tiny_flux3_components(*, distilled: bool, seed: int = 0):
    """The tiny random reference modules (float32, eval mode): transformer, text encoder, VAE, tokenizer."""
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    transformer = Flux3Transformer2DModel(**FLUX3_TRANSFORMER, flow_map=distilled)
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**QWEN3_VL))
    vae = AutoencoderKLFlux2(**VAE)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tokenizer.chat_template = QWEN3_VL_TEMPLATE
    modules = (randomize_(m, seed + i).eval() for i, m in enumerate((transformer, text_encoder, vae)))
    return (*modules, tokenizer)


def flux3_blocks(*, distilled: bool):
    """diffusers' FLUX 3 auto blocks without the prompt upsampler (prompts are encoded as given)."""
    from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks

    blocks = Flux3DistilledAutoBlocks() if distilled else Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    return blocks


def make_tiny_flux3_snapshot(folder: str | Path, *, distilled: bool, seed: int = 0) -> Path:
    """Write a tiny random FLUX 3 Image Klein snapshot (hub layout, float32) to `folder`; return it.

    `distilled` True: the step-distilled flow-map model (transformer `flow_map`, `ref_time_in`);
    False: Base. The same `seed` always gives the same weights.
    """
    folder = Path(folder)
    transformer, text_encoder, vae, tokenizer = make_tiny_flux3_components(distilled=distilled, seed=seed)
    pipe = flux3_blocks(distilled=distilled).init_pipeline()
    pipe.update_components(transformer=transformer, text_encoder=text_encoder, vae=vae, tokenizer=tokenizer)
    # A small shard size splits the text encoder into 2 shards + index, as the real (8.9 GB) one is.
    pipe.save_pretrained(str(folder), max_shard_size="6MB", overwrite_modular_index=True)

    for file in sorted((folder / "tokenizer").iterdir()):
        shutil.move(str(file), folder / "text_encoder" / file.name)
    (folder / "tokenizer").rmdir()
    index_path = folder / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    for name in ("text_encoder", "tokenizer", "vae", "transformer"):
        spec = index[name][2]
        spec["pretrained_model_name_or_path"] = HUB_REPOS[distilled]
    index["tokenizer"] = ["transformers", "AutoProcessor", {**index["tokenizer"][2], "subfolder": "text_encoder"}]
    index["tokenizer"][2]["type_hint"] = ["transformers", "AutoProcessor"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


_SHARED: dict[tuple, Path] = {}


def shared_tiny_flux3_snapshot(tmp_path_factory, *, distilled: bool, seed: int = 0) -> Path:
    """`make_tiny_flux3_snapshot` built once per test session (per arguments); treat it as read-only."""
    key = (distilled, seed)
    if key not in _SHARED:
        name = f"tiny-flux3-{'distilled' if distilled else 'base'}-{seed}"
        _SHARED[key] = make_tiny_flux3_snapshot(
            tmp_path_factory.mktemp(name) / "snapshot", distilled=distilled, seed=seed
        )
    return _SHARED[key]


# --- the BFL single file ------------------------------------------------------------------------------

# diffusers -> BFL, the inverse of diffusers' convert_flux3_transformer_checkpoint_to_diffusers:
# whole keys first, else a stack's prefix and then the leaf inside the block (or a modulation's .linear).
FLUX3_BFL_KEYS = {
    "timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
    "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
    "target_timestep_embedder.linear_1.weight": "ref_time_in.in_layer.weight",  # flow map (distilled) only
    "target_timestep_embedder.linear_2.weight": "ref_time_in.out_layer.weight",
    "proj_out.weight": "final_layer.image.linear.weight",
    "norm_out.linear.weight": "final_layer.image.adaLN_modulation.1.weight",  # rows [scale; shift] -> [shift; scale]
}
FLUX3_BFL_PREFIXES = {
    "x_embedders.": "emb_in.",
    "context_embedder.": "txt_in.",
    "mode_blocks.": "content_mode_blocks.",
    "single_transformer_blocks.": "single_blocks.",
}
FLUX3_BFL_LEAVES = {
    "attn.to_q.weight": "q_proj.weight",
    "attn.to_k.weight": "k_proj.weight",
    "attn.to_v.weight": "v_proj.weight",
    "attn.to_out.0.weight": "attn_out.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
    "ff.linear_in.weight": "mlp_in.weight",
    "ff.linear_out.weight": "mlp_out.weight",
    "linear.weight": "lin.weight",
}
REPA_KEY = "repa_projectors.0.weight"  # training-only (REPA projection head): loaders must drop it


def flux3_diffusers_to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a diffusers `Flux3Transformer2DModel` state dict to the BFL single-file names."""
    out = {}
    for key, value in sd.items():
        if key in FLUX3_BFL_KEYS:
            new = FLUX3_BFL_KEYS[key]
        else:
            new = next((bfl + key[len(old) :] for old, bfl in FLUX3_BFL_PREFIXES.items() if key.startswith(old)), key)
            leaf = next((old for old in FLUX3_BFL_LEAVES if new.endswith("." + old)), None)
            new = new if leaf is None else new[: -len(leaf)] + FLUX3_BFL_LEAVES[leaf]
        if key == "norm_out.linear.weight":
            scale, shift = value.chunk(2, dim=0)
            value = torch.cat([shift, scale], 0)
        out[new] = value
    return out


def write_bfl_flux3_file(snapshot: str | Path, path: str | Path, *, prefix: str = "") -> Path:
    """Write the snapshot's transformer as a BFL single file (`model.safetensors` in the hub repos) at `path`.

    Every key gets `prefix` (ComfyUI-style files use "model.diffusion_model."), and the file carries one
    training-only tensor, `REPA_KEY`, as BFL's files do. Returns `path`.
    """
    from diffusers import Flux3Transformer2DModel
    from safetensors.torch import save_file

    model = Flux3Transformer2DModel.from_pretrained(Path(snapshot) / "transformer")
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    sd = flux3_diffusers_to_bfl(model.state_dict())
    sd[REPA_KEY] = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0))
    save_file({prefix + k: v.detach().contiguous() for k, v in sd.items()}, str(path))
    return Path(path)
