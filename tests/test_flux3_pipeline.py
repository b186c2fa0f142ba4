"""FLUX 3 Image Klein end to end: our pipeline against diffusers' modular pipelines on a tiny snapshot.

The snapshot (tests/support/tiny_flux3.py) is written by diffusers itself in the hub layout (the modular
index, transformer/, text_encoder/ holding the tokenizer and template, vae/). diffusers runs it through
`Flux3DistilledAutoBlocks` / `Flux3AutoBlocks` with the prompt upsampler popped (tests/support/flux3_refs.py);
we run it through `flux_klein_mlx.load`. Both get the same injected noise; the `output_type="np"`
images must agree to 1e-3 (float32), as FLUX.2's do (tests/test_pipeline.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from flux3_refs import flux3_canvas, flux3_reference
from refs import noise, picture
from tiny_flux3 import shared_tiny_flux3_snapshot

import flux_klein_mlx

C = 32  # the tiny transformer's token channels (8 latent channels x 2 x 2)
# Over 80 tokens with the template, so its window is 160: the 80-multiple rule is on the path.
LONG_PROMPT = (
    "a red fox standing in fresh snow at the edge of a pine forest at dawn, soft golden light on its fur, "
    "breath visible in the cold air, distant mountains under a pale sky, small birds on the branches, "
    "a frozen stream winding between the trees, tracks in the snow leading away towards an old wooden cabin "
    "with smoke rising from its chimney and a lantern glowing in the window beside a stack of firewood"
)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    return shared_tiny_flux3_snapshot(tmp_path_factory, distilled=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return shared_tiny_flux3_snapshot(tmp_path_factory, distilled=False)


def ours(path, prompt, **settings):
    pipe = flux_klein_mlx.load(path, dtype=settings.pop("dtype", "float32"), cache=False)
    return pipe.generate(prompt, output_type="np", **settings), pipe


def test_text_to_image_with_a_long_prompt_matches_diffusers(distilled):
    lat = noise(64, 80, channels=C)
    theirs = flux3_reference(distilled, prompt=LONG_PROMPT, latents=lat, steps=3)
    image, pipe = ours(distilled, LONG_PROMPT, steps=3, latents=lat, width=80, height=64)
    assert image.shape == theirs.shape == (64, 80, 3) and image.dtype == np.float32
    assert np.abs(image - theirs).max() <= 1e-3
    assert theirs.std() > 0.01
    info = pipe.info
    assert info.family.key == "flux3" and info.is_distilled and info.name == "FLUX 3 Image Klein"
    assert (info.default_steps, info.default_guidance) == (16, None)
    assert pipe.prompt_embeddings([LONG_PROMPT])[0].shape[1] == 160  # the 80-multiple window


def test_base_cfg_with_a_negative_prompt_of_another_length_matches_diffusers(base):
    lat = noise(64, 64, seed=1, channels=C)
    kwargs = dict(negative_prompt="blurry, low quality, watermark, text", latents=lat, steps=2)
    theirs = flux3_reference(base, prompt=LONG_PROMPT, guidance=3.5, **kwargs)
    image, pipe = ours(base, LONG_PROMPT, guidance=3.5, width=64, height=64, **kwargs)
    assert np.abs(image - theirs).max() <= 1e-3
    windows = [e.shape[1] for e in pipe.prompt_embeddings([LONG_PROMPT, kwargs["negative_prompt"]])]
    assert windows == [160, 80]  # cond and uncond in windows of their own: two passes
    assert (pipe.info.default_steps, pipe.info.default_guidance) == (50, 3.5)
    assert pipe.info.name == "FLUX 3 Image Klein Base"


def test_one_odd_sized_reference_runs_on_its_canvas_and_is_cropped_back(distilled):
    ref = picture(72, 40, seed=3)
    width, height, box = flux3_canvas(ref)
    assert (width, height) != ref.size  # the canvas is padded to the token grid
    lat = noise(height, width, seed=2, channels=C)
    theirs = flux3_reference(distilled, prompt="the fox at night", latents=lat, steps=2, images=[ref])
    image, pipe = ours(distilled, "the fox at night", steps=2, latents=lat, images=[ref])
    assert image.shape == theirs.shape == (40, 72, 3)  # the reference's own size
    assert np.abs(image - theirs).max() <= 1e-3
    record = pipe.last_metadata  # the run's canvas, and the box the image was cropped back to
    assert (record["width"], record["height"], record["crop"]) == (width, height, list(box))


def test_two_references_of_different_sizes_match_diffusers(distilled):
    refs = [picture(80, 64, seed=4), picture(64, 112, seed=5)]
    lat = noise(64, 80, seed=6, channels=C)  # the first reference's size
    theirs = flux3_reference(distilled, prompt="the two together", latents=lat, steps=2, images=refs)
    image, _ = ours(distilled, "the two together", steps=2, latents=lat, images=refs)
    assert image.shape == theirs.shape == (64, 80, 3)
    assert np.abs(image - theirs).max() <= 1e-3


def test_a_seed_gives_diffusers_image_for_that_seed(distilled):
    import torch

    g = torch.Generator().manual_seed(7)
    lat = torch.randn((1, C, 4, 5), generator=g, dtype=torch.float32).numpy()  # diffusers' draw for seed 7
    theirs = flux3_reference(distilled, prompt="a lighthouse", latents=lat, steps=2)
    image, _ = ours(distilled, "a lighthouse", steps=2, seed=7, width=80, height=64)
    assert np.abs(image - theirs).max() <= 1e-3


def test_base_once_per_image_text_and_references_equal_the_per_step_path(base):
    from flux_klein_mlx.family.flux3.family import Flux3Steps

    ref = picture(64, 48, seed=8)
    pipe = flux_klein_mlx.load(base, dtype="float32", cache=False)
    job = pipe.prepare("a fox", images=[ref], steps=3, guidance=3.0, negative_prompt="snow", seed=1)
    model = pipe.component("transformer")
    hoisted = Flux3Steps(model, job, low_memory=False)
    assert hoisted.txt_early is not None and hoisted.ref_early is not None
    per_step = Flux3Steps(model, job, low_memory=False)
    per_step.txt_early = per_step.ref_early = None  # every mode recomputed inside each pass
    for i in range(3):
        a, b = hoisted.velocity(job.x, i), per_step.velocity(job.x, i)
        assert float(np.abs(np.array(a) - np.array(b)).max()) <= 1e-5


def test_the_default_dtype_runs(distilled):
    lat = noise(64, 64, seed=9, channels=C)
    theirs = flux3_reference(distilled, prompt="a boat", latents=lat, steps=2)
    image, pipe = ours(distilled, "a boat", steps=2, latents=lat, dtype="bfloat16", width=64, height=64)
    assert pipe.dtype == flux_klein_mlx.dtypes.DTYPES["bfloat16"]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()
    assert np.abs(image - theirs).mean() <= 0.05  # bf16 against diffusers' float32: close, not equal


@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
def test_a_lora_gives_diffusers_image_with_its_load_lora_weights(distilled, tmp_path, layout):
    """A peft LoRA on every block Linear of the snapshot's transformer, saved by diffusers (PEFT names, alpha in
    the metadata) or in BFL names (alpha folded); diffusers' modular pipeline `load_lora_weights` is the judge."""
    import copy

    import torch
    from diffusers.loaders import Flux3LoraLoaderMixin
    from flux3_refs import flux3_pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from flux_klein_mlx.models.flux3.transformer import flux3_name

    pipe = flux3_pipeline(distilled)
    adapted = copy.deepcopy(pipe.transformer)
    names = [n for n, m in adapted.named_modules() if isinstance(m, torch.nn.Linear) and "blocks." in n]
    torch.manual_seed(3)
    adapted.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=names, init_lora_weights=False))
    state = get_peft_model_state_dict(adapted)
    if layout == "diffusers":
        meta = {"r": 4, "lora_alpha": 8, "target_modules": sorted(names)}
        Flux3LoraLoaderMixin.save_lora_weights(tmp_path, state, transformer_lora_adapter_metadata=meta)
        file = tmp_path / "pytorch_lora_weights.safetensors"
    else:  # ComfyUI / ai-toolkit names, alpha / rank folded into B
        file = tmp_path / "comfy.safetensors"
        bfl = {}
        for key, value in state.items():
            name, role = key.rsplit(".lora_", 1)
            bfl[f"diffusion_model.{flux3_name(name)}.lora_{role}"] = value * 2 if role.startswith("B") else value
        save_file({k: v.contiguous() for k, v in bfl.items()}, str(file))
    lat = noise(64, 64, seed=11, channels=C)
    pipe.load_lora_weights(str(file), adapter_name="judge")
    try:
        theirs = flux3_reference(distilled, prompt="a fox", latents=lat, steps=2)
    finally:
        pipe.unload_lora_weights()
    plain = flux3_reference(distilled, prompt="a fox", latents=lat, steps=2)
    image, _ = ours(distilled, "a fox", steps=2, latents=lat, width=64, height=64)
    with_lora = flux_klein_mlx.load(distilled, dtype="float32", cache=False, loras=[file]).generate(
        "a fox", steps=2, latents=lat, width=64, height=64, output_type="np"
    )
    assert np.abs(with_lora - theirs).max() <= 1e-3
    assert np.abs(theirs - plain).max() > 0.02 and np.abs(image - plain).max() <= 1e-3  # the LoRA does something
