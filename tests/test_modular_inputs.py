"""FLUX 3's pure pieces outside the networks against diffusers 0.42.1: the constant-shift schedule and the
time hand-off (FlowMatchEulerDiscreteScheduler(shift=6.93)), the reference pixels and boxes
(`Flux3ImageProcessor.preprocess`, "fill" and "crop"), the crop back (`postprocess`), and the image ids
(`_prepare_image_ids`). Every comparison is exact (max abs diff 0)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids
from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
from PIL import Image

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.family.flux3.references import (
    FLUX3_MAX_REFERENCES,
    check_reference_count,
    prepare_canvas_reference,
    prepare_flux3_references,
)
from flux_klein_mlx.inputs.images import crop_to_box
from flux_klein_mlx.models.rope import image_ids
from flux_klein_mlx.record.output import to_output
from flux_klein_mlx.sampling import flow_timestep, shifted_schedule

SHIFT = 6.93  # FLUX 3 Image Klein's (Flux3SetTimestepsStep's default)
NAME = "FLUX 3 Image Klein"


def noise_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A picture of random pixels: every resize and pad shows in every pixel."""
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(a[..., 0] if channels == 1 else a, mode=mode)


def reference_pixels(image: Image.Image, resize_mode: str) -> tuple[np.ndarray, tuple | None]:
    """diffusers' preprocessed reference as (H, W, 3) float32, and its crop box."""
    x, kwargs = Flux3ImageProcessor().preprocess(image, resize_mode=resize_mode)
    return x[0].permute(1, 2, 0).numpy(), kwargs["reference_crop"]


# --- the schedule and the time hand-off -----------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 3, 16, 50])
def test_shifted_schedule_and_timesteps_equal_the_scheduler(steps):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))  # Flux3SetTimestepsStep's call
    sigmas = shifted_schedule(steps, SHIFT)
    assert len(sigmas) == steps + 1 and sigmas[-1] == 0.0
    assert np.abs(np.array(sigmas, dtype=np.float32) - scheduler.sigmas.numpy()).max() == 0.0
    timesteps = list(scheduler.timesteps) + [torch.zeros(())]  # the denoise step's next_t: 0 after the last
    for i, sigma in enumerate(sigmas):
        # Flux3(Distilled)DenoiseStep: (t / 1000).expand(batch) in float32, before the cast to the model dtype.
        theirs = (timesteps[i] / 1000).expand(2).numpy()
        ours = flow_timestep(sigma, 2)
        assert ours.dtype == mx.float32 and np.abs(np.array(ours) - theirs).max() == 0.0


# --- references -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, mode",
    [
        ((56, 40), "RGB"),  # neither side on the grid: canvas 64 x 48
        ((57, 41), "RGB"),  # odd sides
        ((1000, 750), "RGB"),
        ((10, 7), "RGB"),  # smaller than a token: mirrored edge included, to the 64-px minimum canvas
        ((15, 300), "RGB"),  # one side under a token
        ((2400, 1900), "RGB"),  # over 4 MP: shrunk
        ((2049, 2047), "RGB"),  # under 4 MP but its canvas is over: the 0.5% back-off
        ((5000, 300), "RGB"),  # wider than 4096: shrunk to 4096 wide
        ((8000, 40), "RGB"),  # very wide: 4096 x 20 on a 4096 x 64 canvas
        ((2200, 2000), "RGBA"),  # resized in its own mode, then RGB (diffusers' order)
        ((90, 70), "L"),
    ],
)
def test_one_reference_is_kept_whole_on_its_canvas_as_diffusers(size, mode):
    image = noise_image(*size, mode=mode)
    theirs, box = reference_pixels(image, "fill")
    ours = prepare_canvas_reference(image)
    assert ours.pixels.dtype == np.float32 and ours.pixels.shape == theirs.shape
    assert np.abs(ours.pixels - theirs).max() == 0.0
    assert ours.box == tuple(box)
    # the door for FLUX 3's references (inputs.prepare_flux3_references) gives the same
    pixels, box_again = prepare_flux3_references([image], NAME)
    assert np.abs(pixels[0] - theirs).max() == 0.0 and box_again == ours.box


def test_several_references_are_each_cropped_to_the_grid_as_diffusers(tmp_path):
    """`resize_mode="crop"`, which the encoder step uses for two or more references, one call per image:
    `inputs/images.preprocess_reference` is exactly that (<= 1 MP Lanczos, sizes truncated, centre crop)."""
    images = [noise_image(1500, 900, seed=1), noise_image(300, 217, seed=2)]
    path = tmp_path / "second.png"
    images[1].save(path)
    ours, box = prepare_flux3_references([images[0], path], NAME)
    assert box is None
    for image, pixels in zip(images, ours, strict=True):
        theirs, their_box = reference_pixels(image, "crop")
        assert their_box is None and pixels.shape == theirs.shape
        assert np.abs(pixels - theirs).max() == 0.0
    assert [p.shape for p in ours] == [(784, 1312, 3), (208, 288, 3)]


def test_small_and_long_references_run_as_diffusers_crops_them():
    """Issue 46: FLUX 3 refused a reference with a side under 64 px, or an aspect past 8:1 (FLUX.2's rules,
    spec 8.1), which diffusers' FLUX 3 pipeline takes: `resize_mode="crop"` floors each side to the grid, so a
    100x56 reference runs as 96x48. Each family's input limits are its own."""
    images = [noise_image(100, 56, seed=4), noise_image(40, 100, seed=5), noise_image(900, 100, seed=6)]
    ours, _ = prepare_flux3_references(images, NAME)
    for image, pixels in zip(images, ours, strict=True):
        theirs, _ = reference_pixels(image, "crop")
        assert pixels.shape == theirs.shape and np.abs(pixels - theirs).max() == 0.0
    assert [p.shape[:2] for p in ours] == [(48, 96), (96, 32), (96, 896)]


def test_the_output_is_cropped_back_to_the_reference_as_diffusers():
    canvas, box = reference_pixels(noise_image(57, 41), "fill")  # canvas 64 x 64 (the minimum side)
    shape = (1, 3, *canvas.shape[:2])
    decoded = torch.from_numpy(np.random.default_rng(3).uniform(-1.3, 1.3, shape).astype(np.float32))
    processor = Flux3ImageProcessor()
    for crop in (box, [box]):
        theirs = processor.postprocess(decoded, output_type="np", reference_crop=crop)[0]
        hwc = decoded[0].permute(1, 2, 0).numpy()
        ours = to_output(mx.array(crop_to_box(hwc, box))[None], "np")
        assert ours.shape == theirs.shape == (41, 57, 3)
        assert np.abs(ours - theirs).max() == 0.0
    on_mlx = crop_to_box(mx.array(hwc), box)  # MLX arrays crop alike
    assert np.array_equal(np.array(on_mlx), crop_to_box(hwc, box))


# --- ids --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("h, w, l_coord", [(3, 5, 0), (4, 4, -1), (2, 7, -2)])
def test_flux3_image_ids_equal_diffusers(h, w, l_coord):
    """The target image (l = 0) and references 1 and 2 (l = -1, -2), each on its own grid."""
    ours = image_ids(h, w, scale=0.5, l=l_coord)
    theirs = _prepare_image_ids(h, w, 0.5, l_coord=l_coord).numpy()
    assert ours.dtype == mx.float32 and ours.shape == theirs.shape
    assert np.abs(np.array(ours) - theirs).max() == 0.0


def test_flux2_image_ids_stay_integer_and_unchanged():
    for t in (0, 10, 20):
        y, x = np.divmod(np.arange(3 * 5), 5)  # row-major
        expected = np.stack([np.full(15, t), y, x, np.zeros(15)], axis=1).astype(np.int32)
        ours = image_ids(3, 5, t)
        assert ours.dtype == mx.int32 and np.array_equal(np.array(ours), expected)


# --- one-line refusals ------------------------------------------------------------------------------------


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_more_references_than_the_model_takes_are_refused_in_one_line():
    check_reference_count(FLUX3_MAX_REFERENCES, FLUX3_MAX_REFERENCES, NAME)
    with pytest.raises(FluxKleinError) as e:
        prepare_flux3_references([noise_image(64, 64)] * (FLUX3_MAX_REFERENCES + 1), NAME)
    assert one_line(e) == f"{NAME} takes at most 10 reference images, not 11; pass 10 or fewer"


def test_bad_reference_images_are_refused_in_one_line():
    with pytest.raises(FluxKleinError) as e:
        prepare_canvas_reference(Image.new("RGB", (0, 5)))
    assert "holds no pixel" in one_line(e)
    # several references: a side shorter than one token (16 px) crops to nothing
    with pytest.raises(FluxKleinError) as e:
        prepare_flux3_references([noise_image(10, 100), noise_image(100, 100)], NAME)
    assert one_line(e) == "reference image is 10x100; both sides must be at least 16 px"
    with pytest.raises(FluxKleinError) as e:
        prepare_flux3_references(["/nonexistent.png"], NAME)
    assert "reference image not found" in one_line(e)
