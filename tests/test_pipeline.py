"""End-to-end parity with diffusers on a complete tiny model of each family, then FLUX.2 [klein]'s run nouns.

Each family's tiny snapshot is written in its exact Hugging Face layout (FLUX.2: model_index.json,
transformer/, text_encoder/, tokenizer/ with the real Qwen3 tokenizer files, vae/, scheduler/; FLUX 3: the
modular index, text_encoder/ holding the tokenizer and template). diffusers runs it through its own
pipeline (the kit's `reference_image`: Flux2KleinPipeline, or the modular Flux3(Distilled)AutoBlocks with the
prompt upsampler popped); we run it through `flux_klein_mlx.load`; both get the same injected noise, and the
`output_type="np"` images must agree to 1e-3 (float32). What only FLUX 3 has (the canvas of one reference,
Base's once-per-image modes) is in tests/test_modular_pipeline.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import KITS
from PIL import Image
from refs import noise, picture

import flux_klein_mlx
from flux_klein_mlx.errors import FluxKleinError

# Over 80 tokens with either template, so FLUX 3's window is 160: the 80-multiple rule is on the path.
LONG_PROMPT = (
    "a red fox standing in fresh snow at the edge of a pine forest at dawn, soft golden light on its fur, "
    "breath visible in the cold air, distant mountains under a pale sky, small birds on the branches, "
    "a frozen stream winding between the trees, tracks in the snow leading away towards an old wooden cabin "
    "with smoke rising from its chimney and a lantern glowing in the window beside a stack of firewood"
)


def run_both(kit, path, prompt, *, latents, steps, **settings):
    """(our float32 image, diffusers' image, our pipeline) of one run from the same latents; `settings` are
    the names both sides take: width, height, images, guidance, negative_prompt."""
    theirs = kit.reference_image(path, prompt=prompt, latents=latents, steps=steps, **settings)
    pipe = flux_klein_mlx.load(path, dtype="float32", cache=False)
    ours = pipe.generate(prompt, steps=steps, latents=latents, output_type="np", **settings)
    return ours, theirs, pipe


def test_text_to_image_with_a_long_prompt_matches_diffusers(family, family_distilled):
    lat = noise(64, 80)
    ours, theirs, pipe = run_both(family, family_distilled, LONG_PROMPT, latents=lat, steps=3, width=80, height=64)
    assert ours.shape == theirs.shape == (64, 80, 3) and ours.dtype == np.float32
    assert np.abs(ours - theirs).max() <= 1e-3
    assert theirs.std() > 0.01  # a real image, not a constant
    info = pipe.info
    assert info.family.key == family.name and info.is_distilled and info.name == family.title
    assert (info.default_steps, info.default_guidance) == family.defaults[0]
    assert pipe.prompt_embeddings([LONG_PROMPT])[0].shape[1] == family.windows[0]


def test_one_reference_image_matches_diffusers(distilled):
    ref = picture(100, 72, seed=1)  # cropped to 96x64 by both pipelines
    ours, theirs, _ = run_both(KITS["flux2"], distilled, "make it winter", latents=noise(64, 96), steps=4, images=[ref])
    assert ours.shape == theirs.shape == (64, 96, 3)
    assert np.abs(ours - theirs).max() <= 1e-3


def test_two_references_of_different_sizes_match_diffusers(family, family_distilled):
    refs = [picture(80, 64, seed=4), picture(64, 112, seed=5)]
    lat = noise(64, 80, seed=6)  # no size given: the first reference's
    ours, theirs, _ = run_both(family, family_distilled, "the two together", latents=lat, steps=2, images=refs)
    assert ours.shape == theirs.shape == (64, 80, 3)
    assert np.abs(ours - theirs).max() <= 1e-3


def test_base_cfg_with_a_negative_prompt_of_another_length_matches_diffusers(family, family_base):
    negative = "blurry, low quality, watermark, text"
    guidance = family.defaults[1][1]
    settings = dict(width=64, height=64, guidance=guidance, negative_prompt=negative)
    ours, theirs, pipe = run_both(family, family_base, LONG_PROMPT, latents=noise(64, 64, seed=1), steps=2, **settings)
    assert np.abs(ours - theirs).max() <= 1e-3
    windows = [e.shape[1] for e in pipe.prompt_embeddings([LONG_PROMPT, negative])]
    assert windows == list(family.windows)  # FLUX 3: cond and uncond in windows of their own, two passes
    assert not pipe.info.is_distilled and (pipe.info.default_steps, pipe.info.default_guidance) == family.defaults[1]
    assert pipe.info.name == family.title + " Base"


def test_base_default_negative_prompt_is_empty(family, family_base):
    lat = noise(64, 96)
    settings = dict(width=96, height=64, guidance=2.5)
    ours, theirs, _ = run_both(family, family_base, "a lighthouse at dusk", latents=lat, steps=2, **settings)
    assert np.abs(ours - theirs).max() <= 1e-3


def test_a_seed_gives_diffusers_image_for_that_seed(family, family_distilled):
    g = torch.Generator().manual_seed(7)
    lat = torch.randn((1, 32, 4, 5), generator=g, dtype=torch.float32).numpy()  # diffusers' draw for seed 7
    theirs = family.reference_image(family_distilled, prompt="a lighthouse", latents=lat, steps=2)
    pipe = flux_klein_mlx.load(family_distilled, dtype="float32", cache=False)
    image = pipe.generate("a lighthouse", steps=2, seed=7, width=80, height=64, output_type="np")
    assert np.abs(image - theirs).max() <= 1e-3


def test_the_default_dtype_is_bfloat16_close_to_float32_and_to_diffusers(family, family_distilled):
    lat = noise(64, 64)
    settings = dict(steps=4, width=64, height=64, latents=lat, output_type="np")
    theirs = family.reference_image(family_distilled, prompt="x", latents=lat, steps=4)
    pipe = flux_klein_mlx.load(family_distilled, cache=False)
    b16 = pipe.generate("x", **settings)
    f32 = flux_klein_mlx.load(family_distilled, dtype="float32", cache=False).generate("x", **settings)
    assert pipe.dtype == flux_klein_mlx.dtypes.DTYPES["bfloat16"]
    assert b16.shape == (64, 64, 3) and np.isfinite(b16).all()
    assert np.abs(b16 - theirs).mean() <= 0.05  # bf16 against diffusers' float32: close, not equal
    assert np.abs(f32 - b16).max() < family.bfloat16_max  # images in [0, 1]


def test_stream_yields_every_step_and_stats(distilled):
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    events = list(pipe.stream("x", width=64, height=64, seed=3))
    assert [e.stage for e in events] == ["encode", "denoise", "denoise", "denoise", "denoise", "decode"]
    assert [e.step for e in events if e.stage == "denoise"] == [1, 2, 3, 4]
    stats = events[-1].stats
    for stage in ("encode", "denoise", "decode"):
        assert getattr(stats, stage).seconds > 0 and getattr(stats, stage).peak_memory > 0
    assert isinstance(events[-1].image, Image.Image) and events[-1].image.size == (64, 64)
    # The text encoder was released after encoding; the prompt's embeddings are cached.
    assert not pipe.is_loaded("text_encoder") and pipe.is_loaded("transformer")


def test_seed_reproducible_and_low_memory_staging(distilled):
    pipe = flux_klein_mlx.load(distilled, dtype="float32", low_memory=True)
    a = pipe.generate("a boat", width=64, height=64, seed=11, output_type="np")
    assert not pipe.is_loaded("transformer") and not pipe.is_loaded("text_encoder")  # both released
    b = pipe.generate("a boat", width=64, height=64, seed=11, output_type="np")
    c = pipe.generate("a boat", width=64, height=64, seed=12, output_type="np")
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_guidance_on_distilled_is_ignored_with_warning(distilled):
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    lat = noise(64, 64)
    plain = pipe.generate("x", width=64, height=64, latents=lat, output_type="np")
    with pytest.warns(UserWarning, match="guidance 3.5 is ignored"):
        guided = pipe.generate("x", width=64, height=64, latents=lat, guidance=3.5, output_type="np")
    assert np.array_equal(plain, guided)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(width=1000, height=64), "width 1000 is not a multiple of 16; use e.g. 992 or 1008"),
        (dict(width=64, height=32), "height 32 is below the minimum of 64 px"),
        (dict(width=64, height=64, images=["/nonexistent.png"]), "reference image not found"),
        (dict(width=64, height=64, latents=np.zeros((1, 3, 4, 4), np.float32)), "latents must have shape"),
    ],
)
def test_bad_generate_arguments(distilled, kwargs, message):
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    with pytest.raises(FluxKleinError, match=message):
        pipe.generate("x", **kwargs)


def test_bad_reference_images(distilled, tmp_path):
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    with pytest.raises(FluxKleinError, match="at least 64 px"):
        pipe.generate("x", width=64, height=64, images=[picture(48, 96)])
    with pytest.raises(FluxKleinError, match="aspect ratio"):
        pipe.generate("x", width=64, height=64, images=[picture(64, 576)])
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(FluxKleinError, match="cannot read reference image"):
        pipe.generate("x", width=64, height=64, images=[broken])


def test_non_finite_values_are_reported(distilled):
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    lat = noise(64, 64)
    model = pipe.component("transformer")
    model.final_layer.linear.weight = model.final_layer.linear.weight * float("nan")  # a damaged weight
    with pytest.raises(FluxKleinError, match="non-finite values appeared at denoising step 1"):
        pipe.generate("x", width=64, height=64, latents=lat)
    lat[0, 0, 0, 0] = np.nan  # non-finite given noise is refused before any step, not blamed on the weights
    with pytest.raises(FluxKleinError, match="latents hold NaN or infinity"):
        pipe.generate("x", width=64, height=64, latents=lat)


def test_converted_folder_gives_the_same_image(distilled, tmp_path):
    """`load` on a folder written by `convert` runs the same model as on the diffusers snapshot."""
    from flux_klein_mlx.convert import convert_model

    out = tmp_path / "mlx"
    convert_model(distilled, out, dtype="float32")
    lat = noise(64, 64)
    a = flux_klein_mlx.load(distilled, dtype="float32").generate(
        "a boat", width=64, height=64, latents=lat, output_type="np"
    )
    pipe = flux_klein_mlx.load(out, dtype="float32")
    b = pipe.generate("a boat", width=64, height=64, latents=lat, output_type="np")
    assert np.abs(a - b).max() <= 1e-5
    assert pipe.info.is_distilled and pipe.quantization is None


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_at_load_within_the_familys_bound_and_convert_quantizes_alike(
    family, family_distilled, tmp_path, cli, bits
):
    """`load(..., quantize=b)` quantizes transformer and text encoder in memory: against float32 (three steps at
    64x64, seed 6) the image moves, within the family's calibrated bound (the kit's `quantized_bounds`); a
    folder written by `convert --quantize` gives load-time quantization's image exactly."""
    from flux_klein_mlx.models.quantize import is_quantized

    settings = dict(steps=3, width=64, height=64, latents=noise(64, 64, seed=6), output_type="np")
    full = flux_klein_mlx.load(family_distilled, dtype="float32", cache=False).generate("a fox", **settings)
    quantized = flux_klein_mlx.load(family_distilled, dtype="float32", quantize=bits, cache=False)
    image = quantized.generate("a fox", **settings)
    assert quantized.quantization["bits"] == bits and is_quantized(quantized.component("transformer"))
    statistic, bound = family.quantized_bounds[bits]
    assert 0 < getattr(np, statistic)(np.abs(image - full)) <= bound
    out = tmp_path / f"q{bits}"
    args = ("--output", out, "--dtype", "float32", "--quantize", bits)
    code, _, err = cli("convert", "--model", family_distilled, *args)
    assert code == 0, err
    converted = flux_klein_mlx.load(out, dtype="float32", cache=False)
    assert converted.quantization["bits"] == bits and converted.info.family.key == family.name
    np.testing.assert_array_equal(converted.generate("a fox", **settings), image)


# --- the run's nouns: settings, inputs, memory plan ------------------------------------------------------


def test_references_are_read_and_encoded_once_per_batch(distilled, tmp_path, monkeypatch):
    """`generate -n 2 --image R`: R is decoded once (before any model runs) and VAE-encoded once."""
    import flux_klein_mlx.inputs.images as images_module  # where the run's images are opened
    from flux_klein_mlx.__main__ import main
    from flux_klein_mlx.models.vae import AutoEncoder

    ref = tmp_path / "ref.png"
    picture(64, 64, 3).save(ref)
    opened, encoded = [], []
    real_open, real_encode = images_module.open_image, AutoEncoder.encode_to_tokens
    monkeypatch.setattr(images_module, "open_image", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    monkeypatch.setattr(
        AutoEncoder, "encode_to_tokens", lambda self, x: encoded.append(x.shape) or real_encode(self, x)
    )
    args = [
        "generate",
        "-m",
        str(distilled),
        "-p",
        "x",
        "-i",
        str(ref),
        "-n",
        "2",
        "--seed",
        "1",
        "--steps",
        "1",
        "--dtype",
        "float32",
        "-o",
        str(tmp_path / "out.png"),
    ]
    assert main(args) == 0
    assert opened == [str(ref)] and len(encoded) == 1


def test_memory_plan_parts_can_be_chosen_alone(distilled):
    from flux_klein_mlx.events import MemoryPlan

    assert (
        MemoryPlan.of(True)
        == MemoryPlan(blockwise=True, tiled_decode=True, release_models=True, drop_lora_originals=True)
        and MemoryPlan.of(False) == MemoryPlan()
    )
    lat = noise(64, 64)
    whole = flux_klein_mlx.load(distilled, dtype="float32").generate(
        "x", width=64, height=64, latents=lat, output_type="np"
    )
    tiled = flux_klein_mlx.load(distilled, dtype="float32", low_memory=MemoryPlan(tiled_decode=True))
    image = tiled.generate("x", width=64, height=64, latents=lat, output_type="np")
    assert tiled.is_loaded("transformer") and tiled.is_loaded("vae")  # nothing released: only the decode is tiled
    np.testing.assert_allclose(image, whole, atol=1e-5)
    with pytest.raises(FluxKleinError, match="low_memory must be True, False or a MemoryPlan"):
        flux_klein_mlx.load(distilled, low_memory="yes")


def test_settings_are_declared_once_and_checked_once(distilled):
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    with pytest.raises(FluxKleinError, match="unknown setting 'stpes'; the settings are"):
        pipe.generate("x", stpes=3)
    stream = pipe.stream("x", width=64, height=64, steps=2, seed=1)
    next(stream)  # the run is open
    with pytest.raises(FluxKleinError, match="while a stream"):
        pipe.set_loras([])
    stream.close()
    pipe.set_loras([])  # closed: allowed again


def test_the_decode_goes_in_bands_past_what_the_whole_image_decode_can_hold(distilled, monkeypatch):
    """Issue 38: MLX's CPU conv unfolds a whole image into one float32 im2col buffer (W·H·c_1·9 values,
    155 GB for klein at 4096²), and a failed allocation there is a segfault. Past MLX's index limit or
    a share of the machine's memory the pipeline decodes in bands by itself; both thresholds are lowered
    here so 64x64 takes that path, and the image is the whole-image decode's."""
    from flux_klein_mlx import limits
    from flux_klein_mlx.models.vae import Decoder

    banded, real = [], Decoder.decode_tiled
    monkeypatch.setattr(Decoder, "decode_tiled", lambda self, *a, **k: banded.append(1) or real(self, *a, **k))
    pipe, lat = flux_klein_mlx.load(distilled, dtype="float32"), noise(64, 64)
    whole = pipe.generate("x", width=64, height=64, latents=lat, output_type="np")
    assert banded == []  # nothing near a limit: the whole image at once, as before
    values = limits.untiled_im2col_values(pipe.component("vae").config, 64, 64)
    monkeypatch.setattr(limits, "INDEX_LIMIT", values - 1)  # past the index limit
    by_index = pipe.generate("x", width=64, height=64, latents=lat, output_type="np")
    monkeypatch.setattr(limits, "INDEX_LIMIT", 2**31 - 1)
    # past UNTILED_SHARE of the machine, while the size itself still passes (klein's bf16 decode: 5.2 MB)
    monkeypatch.setattr(limits, "machine_memory", lambda: (8 * 10**6, "a test machine"))
    assert values * 4 > limits.UNTILED_SHARE * 8 * 10**6
    by_memory = pipe.generate("x", width=64, height=64, latents=lat, output_type="np")
    assert banded == [1, 1]
    np.testing.assert_allclose(by_index, whole, atol=1e-5)
    np.testing.assert_allclose(by_memory, whole, atol=1e-5)
