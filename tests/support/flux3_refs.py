"""diffusers' FLUX 3 modular pipeline run on a tiny snapshot: the reference of the FLUX 3 parity tests.

`flux3_reference` generates one image with diffusers' `Flux3DistilledAutoBlocks` / `Flux3AutoBlocks`
(the prompt upsampler popped: prompts are encoded as given) from injected latents, float32, on the
CPU; `flux3_reference_run` also gives the final latents. The pipeline is loaded once per snapshot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

_PIPELINES: dict[str, object] = {}  # snapshot path -> its diffusers modular pipeline


class Flux3Run(NamedTuple):
    image: np.ndarray  # (H, W, 3) float32 in [0, 1]: diffusers' output_type "np"
    latents: np.ndarray  # (1, C, h, w) float32: the denoised latents before BN-denormalization and decode


def flux3_is_distilled(snapshot) -> bool:
    """True for a step-distilled (flow-map) snapshot, by its modular_model_index.json."""
    index = json.loads((Path(snapshot) / "modular_model_index.json").read_text())
    return index["_blocks_class_name"] == "Flux3DistilledAutoBlocks"


def flux3_pipeline(snapshot):
    """diffusers' FLUX 3 modular pipeline on the snapshot's components, float32, loaded once per snapshot.

    Components are read from the snapshot's subfolders (its modular index names the hub repo, as the
    real one does); the tokenizer is `Qwen3VLProcessorShim` around `text_encoder/`'s tokenizer files
    and chat template. Callers must not change its weights.
    """
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
    from flux3_text import Qwen3VLProcessorShim
    from tiny_flux3 import flux3_blocks
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    key = str(Path(snapshot).resolve())
    if key not in _PIPELINES:
        folder = Path(snapshot)
        pipe = flux3_blocks(distilled=flux3_is_distilled(folder)).init_pipeline()
        pipe.update_components(
            transformer=Flux3Transformer2DModel.from_pretrained(folder / "transformer").eval(),
            text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(folder / "text_encoder").eval(),
            vae=AutoencoderKLFlux2.from_pretrained(folder / "vae").eval(),
            tokenizer=Qwen3VLProcessorShim(AutoTokenizer.from_pretrained(folder / "text_encoder")),
        )
        pipe.load_components()  # the from_config ones: scheduler (shift 6.93) and, on Base, the guider
        _PIPELINES[key] = pipe
    return _PIPELINES[key]


def flux3_reference_run(
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
) -> Flux3Run:
    """One image and its final latents from diffusers' FLUX 3 pipeline.

    latents: the initial noise in diffusers' layout (1, C, H/16, W/16) float32 (C = the transformer's
    in_channels). images: reference PIL images (None for text to image). Without width/height a text
    to image run takes its size from the latents' grid, and a reference run diffusers' default (the
    first reference's canvas; one reference is cropped back to its own size). guidance (Base only):
    the CFG scale, diffusers' 3.5 when None; negative_prompt (Base only): "" when None.
    """
    pipe = flux3_pipeline(snapshot)
    distilled = flux3_is_distilled(snapshot)
    assert not distilled or (guidance is None and negative_prompt is None), "the distilled model has no CFG"
    if not distilled:
        scale = 3.5 if guidance is None else guidance
        pipe.update_components(guider=pipe.get_component_spec("guider").create(guidance_scale=scale))
    kwargs = {} if negative_prompt is None else {"negative_prompt": negative_prompt}
    if images is not None:
        kwargs["image"] = list(images)
    elif width is None and height is None:
        height, width = 16 * latents.shape[2], 16 * latents.shape[3]
    with torch.no_grad():
        out = pipe(
            prompt=prompt,
            latents=torch.from_numpy(np.asarray(latents, dtype=np.float32)),
            num_inference_steps=steps,
            width=width,
            height=height,
            output_type="np",
            output=["images", "latents"],
            **kwargs,
        )
    return Flux3Run(np.asarray(out["images"][0], dtype=np.float32), out["latents"].to(torch.float32).numpy().copy())


def flux3_canvas(image) -> tuple[int, int, tuple[int, int, int, int]]:
    """diffusers' canvas for one reference image: (width, height, crop box (left, top, right, bottom)).

    The latents of a one-reference run without a size are (1, C, height/16, width/16).
    """
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

    pixels, post = Flux3ImageProcessor().preprocess(image, resize_mode="fill")
    return pixels.shape[-1], pixels.shape[-2], post["reference_crop"]


def flux3_reference(snapshot, **kwargs) -> np.ndarray:
    """diffusers' FLUX 3 image, (H, W, 3) float32 in [0, 1]; the arguments of `flux3_reference_run`."""
    return flux3_reference_run(snapshot, **kwargs).image


def flux3_upsampled_run(snapshot, upsampler, *, prompt: str, latents: np.ndarray, steps: int, images=None, boxes=None,
                        max_new_tokens: int) -> tuple[Flux3Run, str]:  # fmt: skip
    """diffusers' whole FLUX 3 chain with the prompt upsampler kept (`Flux3DistilledAutoBlocks` as shipped):
    (the image and latents, the caption the text encoder read). `upsampler`: (model, processor) of
    tests/support/tiny_pup.py; `max_new_tokens` caps the caption (the tiny model never stops on its own)."""
    from diffusers.modular_pipelines import Flux3DistilledAutoBlocks

    base = flux3_pipeline(snapshot)  # the snapshot's components, loaded once
    assert flux3_is_distilled(snapshot), "the chain is checked on the distilled model"
    pipe = Flux3DistilledAutoBlocks().init_pipeline()
    names = ("transformer", "text_encoder", "vae", "tokenizer", "scheduler")
    pipe.update_components(
        **{n: base.get_component(n) if hasattr(base, "get_component") else getattr(base, n) for n in names},
        prompt_upsampler=upsampler[0],
        prompt_upsampler_processor=upsampler[1],
    )
    kwargs = {"image": list(images)} if images is not None else {}
    if images is None:
        kwargs.update(height=16 * latents.shape[2], width=16 * latents.shape[3])
    with torch.no_grad():
        out = pipe(
            prompt=prompt,
            boxes=boxes,
            max_new_tokens=max_new_tokens,
            latents=torch.from_numpy(np.asarray(latents, dtype=np.float32)),
            num_inference_steps=steps,
            output_type="np",
            output=["images", "latents", "prompt"],
            **kwargs,
        )
    run = Flux3Run(np.asarray(out["images"][0], dtype=np.float32), out["latents"].to(torch.float32).numpy().copy())
    return run, out["prompt"]
