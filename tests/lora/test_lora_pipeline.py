"""LoRAs through the whole pipeline of each family's tiny distilled snapshot, written once for both families (issue
45): each file layout of one peft adapter (diffusers/PEFT, BFL as ComfyUI / ai-toolkit write it, BFL block names
only, kohya, LoKr) judged by the image diffusers gives with the family's `load_lora_weights` (FLUX.2's
Flux2KleinPipeline, FLUX 3's modular pipeline: tests/support/flux3_refs.py); two LoRAs at once with scales; a
quantized model with a LoRA; unfusing; low memory; `generate --lora`; `convert --lora`.

Where diffusers has no converter for a layout on a family, the judge is diffusers' image of the PEFT file of the same
weights (tests/support/tiny_loras.py's JUDGE says which file diffusers loads for each). FLUX.2's own namings (fused
q/k/v ranks, kohya's alpha, the final layer's halves, other Mac trainers' files) and every refusal are
tests/lora/test_lora.py's; the LoRA machinery on the bare transformer is tests/lora/test_lora_transformer.py's.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from refs import noise
from tiny_loras import (
    JUDGE,
    Rand,
    diffusers_lora_image,
    peft_adapter,
    save_bfl,
    save_dense_twin,
    save_diffusers,
    save_kohya,
)

import flux_klein_mlx
from flux_klein_mlx.lora.layers import LoRALinear

H = W = 64
STEPS = 2
PROMPT = "a lighthouse at dusk"


class Kit:
    """One family's snapshot, its LoRA files of one adapter, diffusers' pipeline and ours, and the images made."""

    def __init__(self, family, snapshot, folder):
        self.family, self.snapshot, self.lora = family, snapshot, family.lora
        self.judge = self.lora.judge_pipeline(snapshot)
        reference = self.judge.transformer
        sd, config = peft_adapter(reference, seed=11)
        (folder / "a").mkdir()
        (folder / "b").mkdir()
        bfl = self.lora.bfl(sd)
        self.files = {
            "diffusers": save_diffusers(self.lora.mixin, folder / "a", sd, config),
            "bfl": save_bfl(folder / "bfl.safetensors", bfl),
            "bfl-blocks": save_bfl(folder / "bflb.safetensors", bfl, blocks_only=True),
            "kohya": save_kohya(folder / "kohya.safetensors", bfl),
        }
        self.files["lokr"] = str(folder / "lokr.safetensors")
        deltas = self.lora.diffusers_deltas(self.lora.lokr(self.files["lokr"], Rand(21), self.params()), reference)
        self.files["lokr-twin"] = save_dense_twin(folder / "lokr-twin.safetensors", deltas)
        self.second = save_diffusers(self.lora.mixin, folder / "b", *peft_adapter(reference, seed=12))
        self.lat = noise(H, W, seed=5)
        self.ours = flux_klein_mlx.load(snapshot, dtype="float32")
        self.memo = {}

    def params(self):
        from flux_klein_mlx.run.loading import describe

        return describe(self.snapshot).params

    def theirs(self, files=()):
        """diffusers' image with `files` [(path, scale)] loaded as adapters (none: the plain model), memoised."""
        key = repr(files)
        if key not in self.memo:
            run = dict(prompt=PROMPT, latents=self.lat, steps=STEPS)
            self.memo[key] = diffusers_lora_image(self.lora, self.judge, self.snapshot, list(files), **run)
        return self.memo[key]

    def generate(self, pipe, loras=None):
        """Our image from `pipe` (`loras` set first unless None), the prompt's embeddings the module pipeline's."""
        if loras is not None:
            pipe.set_loras(loras)
        if pipe is not self.ours:
            pipe.remember_prompt(PROMPT, self.ours.encode_prompts([PROMPT]))  # only the transformer differs
        return pipe.generate(PROMPT, width=W, height=H, steps=STEPS, latents=self.lat, output_type="np")


@pytest.fixture(scope="module")
def kit(family, family_distilled, tmp_path_factory):
    return Kit(family, family_distilled, tmp_path_factory.mktemp(f"lora-pipeline-{family.name}"))


def check(ours, theirs, plain):
    err = float(np.abs(ours - theirs).max())
    print(f"max abs vs diffusers {err:.2e}")
    assert err <= 1e-3, err
    assert np.abs(theirs - plain).max() > 0.02  # the LoRA changes the image: the comparison is not vacuous


FORMATS = {"diffusers": "diffusers", "bfl": "bfl", "bfl-blocks": "bfl", "kohya": "kohya", "lokr": "lokr"}


@pytest.mark.parametrize("layout", list(FORMATS))
def test_each_layout_gives_diffusers_image(kit, layout):
    """Our `loras=` image equals diffusers' `load_lora_weights` image of the file JUDGE names for the layout."""
    img = kit.generate(kit.ours, [kit.files[layout]])
    assert kit.ours.loras[0].format == FORMATS[layout]
    check(img, kit.theirs([(kit.files[JUDGE[layout]], 1.0)]), kit.theirs())


def test_two_loras_with_scales_match_set_adapters(kit):
    img = kit.generate(kit.ours, [(kit.files["kohya"], 0.7), (kit.second, 1.3)])  # mixed layouts too
    check(img, kit.theirs([(kit.files["diffusers"], 0.7), (kit.second, 1.3)]), kit.theirs())


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_model_with_a_lora_is_within_the_familys_bound_of_diffusers(kit, bits):
    """A 4/8-bit model keeps every quantized layer packed and adds the LoRA beside it; its image is as close to
    diffusers' LoRA image as the family's quantized image is to its float one (the kit's `quantized_bounds`)."""
    pipe = flux_klein_mlx.load(kit.snapshot, dtype="float32", quantize=bits, loras=[(kit.files["diffusers"], 0.9)])
    img = kit.generate(pipe)
    statistic, bound = kit.family.quantized_bounds[bits]
    want = kit.theirs([(kit.files["diffusers"], 0.9)])
    err = float(getattr(np, statistic)(np.abs(img - want)))
    print(f"{kit.family.name} {bits}-bit + LoRA vs diffusers: {statistic} {err:.2e} (bound {bound})")
    assert err < bound
    assert float(getattr(np, statistic)(np.abs(want - kit.theirs()))) > 2 * err  # the LoRA shows through the error
    model = pipe.component("transformer")
    wrapped = {p for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert len(wrapped) >= 20 and not any(
        type(m).__name__ == "Linear" and p in wrapped for p, m in model.named_modules()
    )


def test_unfuse_restores_weights_bit_for_bit_and_set_loras_does_not_reload(kit):
    a, b = kit.files["diffusers"], kit.files["bfl"]
    for dtype in ("bfloat16", "float32"):
        pipe = flux_klein_mlx.load(kit.snapshot, dtype=dtype)
        model = pipe.component("transformer")
        base = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
        pipe.set_loras([a, (b, 0.5)])
        assert pipe.component("transformer") is model
        changed = [
            k
            for k, v in tree_flatten(model.parameters())
            if not np.array_equal(np.array(v.astype(mx.float32)), base[k])
        ]
        assert len(changed) >= 20
        pipe.set_loras([(b, 1.5)])
        pipe.set_loras([])
        after = dict(tree_flatten(model.parameters()))
        assert all(np.array_equal(np.array(after[k].astype(mx.float32)), v) for k, v in base.items()), dtype
    # Between images: the same pixels as a fresh load with those LoRAs; back to none, the plain model's.
    pipe = flux_klein_mlx.load(kit.snapshot, dtype="float32", loras=[a])
    first = kit.generate(pipe)
    second = kit.generate(pipe, [(b, 0.5)])
    fresh = kit.generate(kit.ours, [(b, 0.5)])
    assert np.array_equal(second, fresh) and not np.array_equal(first, second)
    plain = kit.generate(kit.ours, [])
    assert np.array_equal(kit.generate(pipe, []), plain) and np.abs(plain - kit.theirs()).max() <= 1e-3
    # A quantized model gets its plain QuantizedLinear layers back.
    pipe = flux_klein_mlx.load(kit.snapshot, dtype="float32", quantize=8, loras=[a])
    model = pipe.component("transformer")
    pipe.set_loras([])
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())


def test_low_memory_reapplies_loras_after_reload(kit):
    a = kit.files["diffusers"]
    pipe = flux_klein_mlx.load(kit.snapshot, dtype="float32", low_memory=True, loras=[(a, 0.8)])
    one = kit.generate(pipe)
    assert not pipe.is_loaded("transformer")  # released after the denoise
    two = kit.generate(pipe)
    plain = kit.generate(kit.ours, [(a, 0.8)])
    assert np.array_equal(one, two) and np.abs(one - plain).max() <= 1e-5
    # No copy of the original weights is kept (the transformer reloads for every image); a change releases it.
    from flux_klein_mlx.lora.apply import applied_loras

    model = pipe.component("transformer")
    assert model.lora_state.fused and not model.lora_state.originals
    pipe.set_loras([])
    assert not pipe.is_loaded("transformer") and applied_loras(pipe.component("transformer")) == []


# --- the CLI and convert --------------------------------------------------------------------------------


def autov3(path) -> str:
    """A1111's LoRA hash (`addnet_hash_safetensors`): sha256 of the file after its header, 12 hex digits."""
    blob = path.read_bytes()
    return hashlib.sha256(blob[8 + int.from_bytes(blob[:8], "little") :]).hexdigest()[:12]


def record(path, scale: float) -> dict:
    """What the PNG's and a converted folder's record say of a LoRA file at `scale`."""
    return {"name": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:12], "scale": scale,
            "autov3": autov3(path)}  # fmt: skip


def test_cli_loras_from_files_and_the_hub_cache_with_png_metadata(kit, tmp_path, cli, monkeypatch):
    import huggingface_hub.constants
    from PIL import Image

    from flux_klein_mlx.errors import FluxKleinError
    from flux_klein_mlx.storage.weights import resolve_lora

    a = tmp_path / "style.safetensors"
    shutil.copyfile(kit.files["diffusers"], a)
    k = tmp_path / "kohya.safetensors"
    shutil.copyfile(kit.files["kohya"], k)
    # `--lora owner/name`: the repo's single .safetensors, from the hub cache, offline
    rev = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hub"
    root = cache / "models--someone--klein-lora"
    (root / "snapshots" / rev).mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    (root / "snapshots" / rev / "README.md").write_text("a LoRA")
    (root / "snapshots" / rev / "kohya.safetensors").write_bytes(k.read_bytes())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    out = tmp_path / "img.png"
    args = ["--prompt", PROMPT, "--seed", "1", "--width", "64", "--height", "64", "--steps", "1", "--dtype", "float32"]
    code, stdout, err = cli("generate", "--model", str(kit.snapshot), *args, "--output", str(out), "--lora", str(a),
                            "--lora", "someone/klein-lora", "--lora-scale", "0.7")  # fmt: skip
    assert code == 0, err
    params = json.loads(Image.open(out).text["flux_klein_mlx"])
    assert params["loras"] == [record(a, 0.7), record(k, 1.0)]
    # A1111's `Lora hashes` name each LoRA by its file stem and A1111's own hash (AutoV3), as Civitai links them
    assert f'Lora hashes: "style: {autov3(a)}, kohya: {autov3(k)}"' in Image.open(out).text["parameters"]
    assert "LoRA style.safetensors" in err
    # `owner/name:file` names the file; a repo with two .safetensors must be told which
    assert resolve_lora("someone/klein-lora:kohya.safetensors").read_bytes() == k.read_bytes()
    (root / "snapshots" / rev / "other.safetensors").write_bytes(k.read_bytes())
    with pytest.raises(FluxKleinError, match=r"has 2 .safetensors files .*; name one as someone/klein-lora:FILE"):
        resolve_lora("someone/klein-lora")
    with pytest.raises(FluxKleinError, match=r"not in the local Hugging Face cache"):
        resolve_lora("someone/not-cached")


@pytest.mark.parametrize("bits, tolerance", [(None, 1e-5), (8, 0.05)])
def test_convert_bakes_loras_and_records_them(kit, tmp_path, bits, tolerance):
    """A converted (optionally 8-bit) folder with LoRAs baked in gives the image of the base model with
    the LoRAs applied at load (float: to float rounding; 8-bit: within the quantize tests' tolerance)."""
    from pathlib import Path

    from flux_klein_mlx.convert import convert_model

    a, k = Path(kit.files["diffusers"]), Path(kit.files["kohya"])
    out = tmp_path / "baked"
    config = convert_model(kit.snapshot, out, dtype="float32", bits=bits, loras=[(a, 0.7), k])
    assert config["loras"] == [record(a, 0.7), record(k, 1.0)]
    assert json.loads((out / "config.json").read_text())["loras"] == config["loras"]
    want = kit.generate(kit.ours, [(a, 0.7), k])
    got = kit.generate(flux_klein_mlx.load(out, dtype="float32"))
    err = float(np.abs(got - want).max())
    print(f"convert --lora (bits={bits}) vs LoRAs at load: max abs {err:.2e}")
    assert err <= tolerance


def test_side_path_on_a_converted_quantized_folder(kit, tmp_path):
    """A 4-bit converted folder takes LoRAs the same way as quantizing at load: the same image."""
    from flux_klein_mlx.convert import convert_model

    out = tmp_path / "q4"
    convert_model(kit.snapshot, out, dtype="float32", bits=4)
    images = []
    for model, kw in ((out, {}), (kit.snapshot, {"quantize": 4})):
        pipe = flux_klein_mlx.load(model, dtype="float32", loras=[(kit.files["diffusers"], 1.2)], **kw)
        images.append(kit.generate(pipe))
        assert any(isinstance(m, LoRALinear) for _, m in pipe.component("transformer").named_modules())
    assert np.abs(images[0] - images[1]).max() <= 1e-5
