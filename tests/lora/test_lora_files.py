"""LoRA files that work where they are used (issues 28, 37): `train --format diffusers|comfyui|kohya`,
`lora convert`, `lora info`, and A1111's LoRA hash. diffusers is the judge.

On each family (written once for both, issue 45): `train` on the tiny Base writes one adapter in the three layouts;
the family's diffusers loader (`Flux2LoraLoaderMixin`, `Flux3LoraLoaderMixin`) reads each with every key used and
every trained module adapted, and its image with each is its image with the diffusers file, and ours. diffusers
reads no kohya FLUX 3 names: that file is judged through `lora convert` to the diffusers layout.

On FLUX.2 [klein]: one LoRA with random non-zero up matrices on every block layer of the tiny model (rank 4,
alpha 8: a factor 2 that a wrong alpha shows) is written in the three layouts: every comfyui key must be
`diffusion_model.` + a 2-D weight of the BFL checkpoint (tiny_model.diffusers_to_bfl), the kohya file has the same
modules with alpha, convert round trips give diffusers' image, the diffusers file folds alpha; `lora info`,
A1111's hash, and every refusal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re

import mlx.core as mx
import numpy as np
import pytest
import torch
from command_line import run_cli
from refs import diffusers_image, diffusers_pipeline, diffusers_pipeline_for_loras, diffusers_prompt_embeds
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_model import diffusers_to_bfl
from train_batch import card_folders

import flux_klein_mlx
from flux_klein_mlx.__main__ import main
from flux_klein_mlx.lora.convert import convert_lora
from flux_klein_mlx.lora.layouts import LAYOUTS, adapter_file
from flux_klein_mlx.record.output import a1111_parameters
from flux_klein_mlx.run.components import load_component
from flux_klein_mlx.run.loading import describe
from flux_klein_mlx.storage.weights import save_safetensors_streaming
from flux_klein_mlx.train.step.adapters import attach_lora, parse_targets, write_lora_file

RANK, ALPHA = 4, 8.0
H = W = 64
STEPS = 2
PROMPT = "a lighthouse at dusk"


@pytest.fixture(scope="module")
def trained(snapshot, tmp_path_factory):
    """The LoRA (random non-zero B, as after training) on every block layer, written in each layout, float32."""
    model = load_component(describe(snapshot), "transformer", mx.float32)
    slots = parse_targets("all", model.params)
    lora = attach_lora(model, slots, rank=RANK, alpha=ALPHA, rng=np.random.default_rng(1))
    g = np.random.default_rng(2)
    values = {}
    for s in slots:
        values[f"{s.name}.down"] = mx.array(
            (g.standard_normal((RANK, s.in_dims)) / math.sqrt(s.in_dims)).astype(np.float32)
        )
        values[f"{s.name}.up"] = mx.array((0.3 * g.standard_normal((s.out_dims, RANK)) / 2).astype(np.float32))
    lora.load(values, "test values")
    folder = tmp_path_factory.mktemp("layouts")
    files = {layout: folder / f"{layout}.safetensors" for layout in LAYOUTS}
    for layout, path in files.items():
        write_lora_file(
            path, lora, dtype=mx.float32, layout=layout, params=model.params, header={"flux_klein_mlx.trigger": "sks"}
        )
    # the training checkpoint's diffusers layout: alpha kept apart from B in PEFT's header (issue 39)
    files["peft"] = folder / "peft.safetensors"
    tensors, header = adapter_file(lora.terms(), "diffusers", model.params, what="peft", fold_alpha=False)
    save_safetensors_streaming(files["peft"], tensors, metadata=header)
    return files


@pytest.fixture(scope="module")
def ref(snapshot):
    """The session's diffusers pipeline with a transformer of our own (LoRAs are loaded into it), the prompt
    encoded once."""
    shared = diffusers_pipeline(snapshot, "plain")
    return (
        diffusers_pipeline_for_loras(snapshot),
        diffusers_prompt_embeds(shared, PROMPT),
        shared.transformer.state_dict(),
        {},
    )


@pytest.fixture(scope="module")
def ours(snapshot):
    return flux_klein_mlx.load(snapshot, dtype="float32")


@pytest.fixture(scope="module")
def lat():
    return np.random.default_rng(5).standard_normal((1, 32, H // 16, W // 16)).astype(np.float32)


def theirs(ref, lat, path=None):
    """diffusers' image with the LoRA file `path` loaded (None: the base model); memoised by the file's bytes."""
    pipe, embeds, _, memo = ref
    key = hashlib.sha256(path.read_bytes()).hexdigest() if path else None
    if key not in memo:
        if path:
            pipe.load_lora_weights(str(path), adapter_name="x")
        try:
            memo[key] = diffusers_image(pipe, embeds, lat, H, STEPS)
        finally:
            if path:
                pipe.delete_adapters("x")
    return memo[key]


def ours_image(pipe, lat, path):
    pipe.set_loras([path])
    return pipe.generate(PROMPT, width=W, height=H, steps=STEPS, latents=lat, output_type="np")


def modules(state_dict) -> set[str]:
    return {k.rsplit(".lora_", 1)[0] for k in state_dict}


@pytest.fixture(scope="module")
def written(family, family_base, tmp_path_factory):
    """`train --format` in each layout on the family's Base (3 steps from one seed: the same adapter in each file,
    on every layer `--targets all` names), with diffusers' pipeline of the Base that judges them (its CFG included)."""
    root = tmp_path_factory.mktemp(f"written-{family.name}")
    photos, _ = card_folders(root)
    files = {}
    for layout in LAYOUTS:
        files[layout] = root / f"{layout}.safetensors"
        args = ["--model", str(family_base), "--data", str(photos), "--output", str(files[layout]), "--format", layout]
        args += ["--steps", "3", "--rank", "4", "--lr", "2e-2", "--resolution", "64", "--dtype", "float32"]
        assert main(["train", *args, "--save-dtype", "float32", "--targets", "all"]) == 0
    targets = json.loads((root / "diffusers.train" / "train.json").read_text())["targets"]
    return files, targets, family.lora.judge_pipeline(family_base), {}


def test_train_writes_each_layout_that_diffusers_reads_whole_and_that_gives_our_image(
    family, family_base, written, lat, tmp_path, caplog
):
    """Each layout `train` writes is read by the family's diffusers loader (`lora_state_dict` +
    `load_lora_into_transformer`, on a copy) with every key used and every trained module adapted, and diffusers'
    image with it equals its image with the diffusers file; our `--lora` reads all three the same way, to diffusers'
    image. diffusers reads no kohya FLUX 3 names: that file is judged through `lora convert` to the diffusers layout."""
    import copy

    import diffusers.loaders
    from diffusers.loaders import lora_conversion_utils
    from tiny_loras import diffusers_lora_image

    files, targets, pipe, _ = written
    loader, run = getattr(diffusers.loaders, family.lora.mixin), dict(prompt=PROMPT, latents=lat, steps=STEPS)
    want = set(targets)
    assert modules(load_file(str(files["diffusers"]))) == {f"transformer.{m}" for m in want}
    every = [s.name for s in parse_targets("all", describe(family_base).params)]
    refs = family.training.reference_blocks  # a text-to-image run leaves the references' own blocks out
    assert len(every) == family.training.lora_slots and want == {n for n in every if not refs or not n.startswith(refs)}
    caplog.set_level(logging.WARNING)
    images = {}
    for layout, path in files.items():
        judge = path
        if layout == "kohya":
            kohya = load_file(str(path))
            assert all(k.startswith("lora_unet_") for k in kohya)
            if family.lora.kohya_converter is None:
                judge = convert_lora(path, tmp_path / "judge.safetensors", "diffusers")
            else:
                getattr(lora_conversion_utils, family.lora.kohya_converter)(kohya)  # pops what it converts
                assert kohya == {}
        sd, meta = loader.lora_state_dict(str(judge), return_lora_metadata=True)
        assert modules(sd) == {f"transformer.{m}" for m in want}, layout  # the converters give every module
        model = copy.deepcopy(pipe.transformer)
        loader.load_lora_into_transformer(sd, transformer=model, adapter_name="judge", metadata=meta)
        assert {n for n, m in model.named_modules() if "judge" in getattr(m, "lora_A", {})} == want, layout
        images[layout] = diffusers_lora_image(family.lora, pipe, family_base, [(judge, 1.0)], **run)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "key" in r.getMessage().lower()]
    plain = diffusers_lora_image(family.lora, pipe, family_base, [], **run)
    assert np.abs(images["diffusers"] - plain).max() > 1e-2  # the trained LoRA changes the image: not vacuous
    for layout in ("comfyui", "kohya"):
        err = np.abs(images[layout] - images["diffusers"]).max()
        print(f"diffusers: {layout} vs diffusers file {err:.2e}")
        assert err <= 1e-4, (layout, err)
    ours = flux_klein_mlx.load(family_base, dtype="float32")
    mine = {}
    for layout, read_as in zip(LAYOUTS, ("diffusers", "bfl", "kohya"), strict=True):  # --lora reads all three alike
        ours.set_loras([files[layout]])
        mine[layout] = ours.generate(PROMPT, width=W, height=H, steps=STEPS, latents=lat, output_type="np")
        assert ours.loras[0].format == read_as
        assert np.abs(mine[layout] - mine["diffusers"]).max() <= 1e-4, layout
    assert np.abs(mine["diffusers"] - images["diffusers"]).max() <= 1e-3


def test_every_comfyui_key_is_a_bfl_weight_and_kohya_has_the_same_modules_with_alpha(trained, ref):
    bfl = diffusers_to_bfl(ref[2])
    comfy = load_file(str(trained["comfyui"]))
    assert not [k for k in comfy if k.endswith(".alpha")]
    names = set()
    for key, value in comfy.items():
        m = re.fullmatch(r"diffusion_model\.(.+)\.lora_([AB])\.weight", key)
        assert m, key
        weight = bfl.get(f"{m.group(1)}.weight")
        assert weight is not None and weight.ndim == 2, key
        assert value.shape[1 if m.group(2) == "A" else 0] == weight.shape[1 if m.group(2) == "A" else 0], key
        names.add(m.group(1))
    assert (
        "double_blocks.0.img_attn.qkv" in names and "single_blocks.1.linear1" in names and len(names) == 2 * 8 + 2 * 2
    )
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape[0] == 3 * RANK  # q, k, v stacked
    kohya = load_file(str(trained["kohya"]))
    assert modules(kohya) == {"lora_unet_" + n.replace(".", "_") for n in names} | {
        "lora_unet_" + n.replace(".", "_") + ".alpha" for n in names
    }
    for n in names:  # alpha / rank = 2 whatever the fused rank
        stem = "lora_unet_" + n.replace(".", "_")
        assert kohya[f"{stem}.alpha"].item() / kohya[f"{stem}.lora_down.weight"].shape[0] == ALPHA / RANK
    with safe_open(str(trained["comfyui"]), "pt") as f:
        meta = f.metadata()
    assert meta["flux_klein_mlx.format"] == "comfyui" and meta["flux_klein_mlx.trigger"] == "sks"
    assert "lora_adapter_metadata" not in meta  # diffusers would take it as this file's PEFT config


def kohya_file(path, g):
    """A musubi-style file: `.alpha` 1 (musubi's default) on a dense rank-6 fused qkv, 3 on a block-diagonal one."""
    sd = {}

    def put(name, out, inp, r, alpha, mask=None):
        down = torch.from_numpy(g.standard_normal((r, inp)).astype(np.float32)) / math.sqrt(inp)
        up = torch.from_numpy(g.standard_normal((out, r)).astype(np.float32)) * 0.5
        sd[f"lora_unet_{name}.lora_down.weight"] = down
        sd[f"lora_unet_{name}.lora_up.weight"] = up if mask is None else up * mask
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)

    D, M = 64, 192
    put("double_blocks_0_img_attn_qkv", 3 * D, D, 6, 1.0)
    mask = torch.zeros(3 * D, 6)
    for j in range(3):
        mask[j * D : (j + 1) * D, 2 * j : 2 * j + 2] = 1
    put("double_blocks_1_txt_attn_qkv", 3 * D, D, 6, 3.0, mask)
    put("double_blocks_0_img_mlp_0", 2 * M, D, 4, 1.0)
    put("single_blocks_0_linear1", 3 * D + 2 * M, D, 4, 2.0)
    put("single_blocks_1_linear2", D, D + M, 4, 4.0)
    save_file(sd, str(path), metadata={"ss_network_module": "networks.lora_flux_2", "ss_network_dim": "6"})
    return path


def convert(capsys, *args):
    rc, out, err = run_cli(capsys, "lora", "convert", *args)
    assert rc == 0, err
    return out


def test_convert_round_trips_give_the_same_image_in_diffusers(trained, ref, lat, tmp_path, capsys):
    """diffusers (the checkpoint's, alpha in the header) -> comfyui -> diffusers (exact: alpha/rank 2 folds
    without rounding), kohya -> diffusers, and a musubi-style kohya file -> comfyui and diffusers."""
    comfy, back, from_kohya = (tmp_path / f"{n}.safetensors" for n in ("comfy", "back", "from-kohya"))
    assert str(comfy) in convert(capsys, trained["peft"], "--output", comfy, "--format", "comfyui")
    convert(capsys, comfy, "--output", back, "--format", "diffusers")
    convert(capsys, trained["kohya"], "--output", from_kohya, "--format", "diffusers")
    a, b = load_file(str(trained["peft"])), load_file(str(back))
    assert a.keys() == b.keys()  # q, k, v back at rank 4; alpha/rank (2) folded into B, exactly
    assert all(torch.equal(b[k], a[k] * (ALPHA / RANK if ".lora_B." in k else 1)) for k in a)
    with safe_open(str(back), "pt") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
    assert (
        config["transformer.r"] == config["transformer.lora_alpha"] == RANK and not config["transformer.rank_pattern"]
    )
    want = theirs(ref, lat, trained["diffusers"])
    for path in (comfy, back, from_kohya, trained["peft"]):
        assert np.abs(theirs(ref, lat, path) - want).max() <= 1e-4, path.name
    musubi = kohya_file(tmp_path / "musubi.safetensors", np.random.default_rng(7))
    source = theirs(ref, lat, musubi)
    assert np.abs(source - theirs(ref, lat)).max() > 0.02
    for layout in ("comfyui", "diffusers"):
        out = tmp_path / f"musubi-{layout}.safetensors"
        convert(capsys, musubi, "--output", out, "--format", layout)
        err = np.abs(theirs(ref, lat, out) - source).max()
        print(f"musubi kohya -> {layout}: {err:.2e}")
        assert err <= 1e-4, layout
    with safe_open(str(tmp_path / "musubi-comfyui.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "6" and "musubi.safetensors (kohya" in meta["flux_klein_mlx.converted_from"]


def test_the_diffusers_file_has_one_effect_in_every_loader_alpha_folded(trained, ref, ours, lat, tmp_path):
    """Rank 4, alpha 8: the diffusers file folds alpha/rank into B (lora_alpha = r in its header), so read
    with its header stripped (as ComfyUI's loader reads, ignoring PEFT's alpha) it is the same update and
    diffusers gives the same image; diffusers' image with the file equals ours and the unfolded file's."""
    with safe_open(str(trained["diffusers"]), "pt") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
    assert config["transformer.r"] == config["transformer.lora_alpha"] == RANK
    folded, apart = load_file(str(trained["diffusers"])), load_file(str(trained["peft"]))
    assert folded.keys() == apart.keys()
    for k in (k for k in folded if ".lora_A." in k):  # alpha ignored: B @ A alone is the whole update
        up = k.replace(".lora_A.", ".lora_B.")
        delta = (folded[up].double() @ folded[k].double()).numpy()
        want = ALPHA / RANK * (apart[up].double() @ apart[k].double()).numpy()
        assert np.abs(delta - want).max() <= 1e-6 * np.abs(want).max(), k
    bare = tmp_path / "no-header.safetensors"  # the tensors alone: no alpha anywhere (diffusers then takes alpha = r)
    save_file(folded, str(bare))
    want = theirs(ref, lat, trained["peft"])
    assert np.abs(want - theirs(ref, lat)).max() > 0.02  # the LoRA shows: a factor 2 lost would show
    for path in (trained["diffusers"], bare):
        assert np.abs(theirs(ref, lat, path) - want).max() <= 1e-4, path.name
    assert np.abs(ours_image(ours, lat, trained["diffusers"]) - want).max() <= 1e-3


def info(capsys, path) -> dict[str, str]:
    rc, out, err = run_cli(capsys, "lora", "info", path)
    assert rc == 0, err
    return dict(re.match(r"([^:]+):\s+(.*)", line).groups() for line in out.splitlines())


def test_lora_info_names_format_ranks_alpha_trainer_and_klein_size(trained, tmp_path, capsys):
    d = info(capsys, trained["kohya"])
    assert d["format"] == "kohya / musubi-tuner" and d["rank"] == "4, 12" and d["alpha"] == "8, 24"
    assert d["modules"] == "20 (on 20 layers)" and d["trigger"] == "sks" and "hidden size 64" in d["model"]
    blob = trained["kohya"].read_bytes()
    n = int.from_bytes(blob[:8], "little")
    assert d["AutoV3"].startswith(hashlib.sha256(blob[8 + n :]).hexdigest()[:12])
    d = info(capsys, kohya_file(tmp_path / "m.safetensors", np.random.default_rng(3)))
    assert d["trainer"] == "kohya sd-scripts / musubi-tuner (networks.lora_flux_2)" and d["rank"] == "4, 6"
    assert d["alpha"] == "1, 2, 3, 4"
    for hidden, name in ((3072, "FLUX.2 [klein] 4B"), (4096, "FLUX.2 [klein] 9B")):
        path = tmp_path / f"{hidden}.safetensors"
        save_file(
            {
                "diffusion_model.double_blocks.1.img_attn.proj.lora_A.weight": torch.zeros(1, hidden),
                "diffusion_model.double_blocks.1.img_attn.proj.lora_B.weight": torch.zeros(hidden, 1),
            },
            str(path),
        )
        d = info(capsys, path)
        assert d["model"] == name and d["format"] == "BFL names (ComfyUI / ai-toolkit)" and d["rank"] == "1"


def test_a1111_lora_hash_is_autov3_of_the_tensor_data(trained, ours, tmp_path):
    """A1111's `addnet_hash_safetensors`: sha256 of the bytes after the header; a changed header keeps it."""
    path = trained["comfyui"]
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    autov3 = hashlib.sha256(blob[8 + n :]).hexdigest()[:12]
    ours.set_loras([path])
    record = ours.loras[0].record()
    assert record["autov3"] == autov3 and record["sha256"] == hashlib.sha256(blob).hexdigest()[:12]
    assert f'Lora hashes: "comfyui: {autov3}"' in a1111_parameters({"prompt": "x", "loras": [record]})
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"]["note"] = "the same tensors under another header"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    other = tmp_path / "renamed.safetensors"
    other.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n :])
    ours.set_loras([other])
    assert ours.loras[0].record()["autov3"] == autov3 and ours.loras[0].sha256 != record["sha256"]


# --- bad input -----------------------------------------------------------------------------------------


def one_line_refusal(capsys, args, match):
    rc, out, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert re.search(match, lines[0]), lines[0]


def lokr(path, part: bool = False):
    """A LoKr on a double block's whole fused qkv (192 x 64), or (`part`) on diffusers' to_q alone (its rows 0-63)."""
    if part:
        save_file(
            {
                "transformer.transformer_blocks.0.attn.to_q.lokr_w1": torch.ones(8, 8),
                "transformer.transformer_blocks.0.attn.to_q.lokr_w2": torch.ones(8, 8),
            },
            str(path),
        )
    else:
        save_file(
            {
                "double_blocks.0.img_attn.qkv.lokr_w1": torch.ones(4, 4),
                "double_blocks.0.img_attn.qkv.lokr_w2": torch.ones(48, 16),
            },
            str(path),
        )
    return path


@pytest.mark.parametrize(
    "case, match",
    [
        ("format", r"--format must be one of diffusers, comfyui, kohya, not 'safetensors'"),
        ("exists", r"exists and is never overwritten"),
        ("truncated", r"truncated|damaged"),
        ("not-safetensors", r"damaged or not a safetensors file"),
        ("checkpoint", r"not LoRA/LoKr weights .*model checkpoint"),
        ("sdxl", r"made for an SDXL / Stable Diffusion UNet"),
        ("lokr", r"is a LoKr, which --format kohya cannot hold; --format comfyui writes it"),
        ("lokr-part", r"the LoKr .*to_q updates part of layer double_blocks.0.img_attn.qkv \(rows 0-64\)"),
        ("info-truncated", r"truncated|damaged"),
    ],
)
def test_lora_convert_and_info_refuse_with_one_line_and_write_nothing(trained, tmp_path, capsys, case, match):
    src, out = trained["diffusers"], tmp_path / "out.safetensors"
    if case == "exists":
        out.write_bytes(b"keep me")
    elif case in ("truncated", "info-truncated"):
        src = tmp_path / "cut.safetensors"
        src.write_bytes(trained["comfyui"].read_bytes()[:-100])
    elif case == "not-safetensors":
        src = tmp_path / "notes.safetensors"
        src.write_text("hello")
    elif case == "checkpoint":
        src = tmp_path / "model.safetensors"
        save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(192, 64)}, str(src))
    elif case == "sdxl":
        src = tmp_path / "sdxl.safetensors"
        save_file(
            {
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 320),
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(320, 4),
            },
            str(src),
        )
    elif case.startswith("lokr"):
        src = lokr(tmp_path / "lokr.safetensors", part=case == "lokr-part")
    before = sorted(p.name for p in tmp_path.iterdir())
    layout = {"format": "safetensors", "lokr-part": "comfyui"}.get(case, "kohya")
    args = (
        ["lora", "info", str(src)]
        if case.startswith("info")
        else ["lora", "convert", str(src), "--output", str(out), "--format", layout]
    )
    one_line_refusal(capsys, args, match)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "exists":
        assert out.read_bytes() == b"keep me"


# --- training in each layout --------------------------------------------------------------------------


def test_train_format_bad_value_is_one_line_before_any_model_loads(base, tmp_path, capsys, monkeypatch):
    import flux_klein_mlx.train.trainer as train_module

    monkeypatch.setattr(train_module, "load_component", lambda *a, **k: pytest.fail("a model was loaded"))
    data = tmp_path / "data"
    data.mkdir()
    from PIL import Image

    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(data / "a.png")
    (data / "a.txt").write_text("a card")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    one_line_refusal(
        capsys,
        [
            "train",
            "--model",
            str(base),
            "--data",
            str(data),
            "--output",
            str(tmp_path / "o.safetensors"),
            "--format",
            "ckpt",
        ],
        r"--format must be one of diffusers, comfyui, kohya, not 'ckpt'",
    )
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    with pytest.raises(flux_klein_mlx.FluxKleinError, match="--format must be one of"):
        flux_klein_mlx.train_lora(model=base, data=data, output=tmp_path / "o.safetensors", format="peft")


def test_train_writes_a_comfyui_file_with_kohya_training_metadata_in_bfloat16(base, tmp_path, cli):
    """The command at its default dtype (bfloat16): the file is the comfyui layout, carries kohya's ss_* keys,
    and loads in our pipeline and in diffusers' converter."""
    from diffusers import Flux2KleinPipeline
    from PIL import Image

    data = tmp_path / "photos"
    data.mkdir()
    g = np.random.default_rng(0)
    for i in range(2):  # one caption text: each distinct caption costs a text-encoder run
        Image.fromarray((g.random((64, 64, 3)) * 255).astype(np.uint8)).save(data / f"im{i}.png")
        (data / f"im{i}.txt").write_text("sks, a fox, sks")
    out = tmp_path / "fox.safetensors"
    rc, _, err = cli(
        "train",
        "--model",
        str(base),
        "--data",
        str(data),
        "--output",
        str(out),
        "--steps",
        "1",
        "--rank",
        "4",
        "--alpha",
        "2",
        "--resolution",
        "64",
        "--format",
        "comfyui",
    )
    assert rc == 0, err
    tensors = mx.load(str(out))
    assert all(k.startswith("diffusion_model.") for k in tensors) and {v.dtype for v in tensors.values()} == {
        mx.bfloat16
    }
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert (
        meta["flux_klein_mlx.format"] == "comfyui"
        and meta["ss_network_dim"] == "4"
        and meta["ss_network_alpha"] == "2.0"
    )
    assert json.loads(meta["ss_tag_frequency"]) == {"photos": {"sks": 2, "a fox": 2}}  # once per caption
    assert (
        meta["ss_num_train_images"] == "2" and meta["ss_max_train_steps"] == "1" and meta["ss_resolution"] == "(64, 64)"
    )
    assert meta["ss_base_model_version"] == "flux_2_klein" and len(meta["flux_klein_mlx.settings_sha256"]) == 64
    assert json.loads((tmp_path / "fox.train" / "train.json").read_text())["settings"]["format"] == "comfyui"
    assert flux_klein_mlx.load(base, loras=[out]).loras[0].format == "bfl"
    assert modules(Flux2KleinPipeline.lora_state_dict(str(out)))  # the converter takes every key (it raises otherwise)
    # `lora info` (issue 39): the trained rank and alpha, not the fused qkv's 12 and 6; the training from the header
    rc, said, err = cli("lora", "info", out)
    assert rc == 0, err
    d = dict(re.match(r"([^:]+):\s+(.*)", line).groups() for line in said.splitlines())
    assert d["rank"] == "4" and d["alpha"] == "2" and d["trainer"].startswith("flux_klein_mlx ")
    assert d["steps"] == "1 of 1" and d["schedule"] == "lr 0.0001 constant" and d["sizes"] == "64x64"
    assert d["dataset"] == "2 images; tags: a fox (2), sks (2)"


def dense_updates(path) -> dict[str, np.ndarray]:
    """Our layer -> the file's summed update on its rows, float64: `factor · up @ down`, or for a LoKr
    `factor · kron(w1, w2)` with its output halves rolled where the file's order is [scale ; shift]."""
    from flux_klein_mlx.lora.convert import read_any_lora
    from flux_klein_mlx.models.flux2.transformer import linear_shapes

    lora = read_any_lora(path)
    shapes = linear_shapes(lora.params)
    out = {}
    for t in lora.parsed.terms:
        full = out.setdefault(t.layer, np.zeros(shapes[t.layer]))
        if t.down is None:
            w1, w2 = (np.asarray(a.astype(mx.float32), np.float64) for a in (t.w1, t.w2))
            delta = t.factor * np.kron(w1, w2)
            full[t.rows[0] : t.rows[1]] += np.roll(delta, delta.shape[0] // 2, axis=0) if t.swap else delta
        else:
            up, down = (np.asarray(a.astype(mx.float32), np.float64) for a in (t.up, t.down))
            full[t.rows[0] : t.rows[1]] += t.factor * up @ down
    return out


def test_lokr_convert_keeps_every_update_the_final_layers_half_order_included(tmp_path):
    """A diffusers-layout LoKr on a fused qkv and on norm_out.linear (diffusers' [scale ; shift] halves, our
    [shift ; scale]), and a LyCORIS one with a low-rank w2 and an alpha: the ComfyUI file holds the same update
    on every layer. A w1 of odd height on those halves cannot be reordered: one line, nothing written."""
    from flux_klein_mlx.errors import FluxKleinError
    from flux_klein_mlx.lora.convert import convert_lora

    g = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    diffusers_lokr, lycoris = tmp_path / "diffusers.safetensors", tmp_path / "lycoris.safetensors"
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_qkv.lokr_w1": rand(4, 4),
            "transformer.transformer_blocks.0.attn.to_qkv.lokr_w2": rand(48, 16),
            "transformer.norm_out.linear.lokr_w1": rand(2, 4),
            "transformer.norm_out.linear.lokr_w2": rand(64, 16),
        },
        str(diffusers_lokr),
    )
    save_file(
        {
            "lycoris_double_blocks_0_img_attn_qkv.lokr_w1": rand(4, 4),
            "lycoris_double_blocks_0_img_attn_qkv.lokr_w2_a": rand(48, 2),
            "lycoris_double_blocks_0_img_attn_qkv.lokr_w2_b": rand(2, 16),
            "lycoris_double_blocks_0_img_attn_qkv.alpha": torch.tensor(1.0),
        },
        str(lycoris),
    )
    for source in (diffusers_lokr, lycoris):
        want = dense_updates(source)
        got = dense_updates(convert_lora(source, tmp_path / f"{source.stem}-comfyui.safetensors", "comfyui"))
        assert got.keys() == want.keys() and len(want) == (2 if source is diffusers_lokr else 1)
        for layer, delta in want.items():
            assert np.abs(got[layer] - delta).max() <= 1e-6 * np.abs(delta).max(), (source.name, layer)
    odd = tmp_path / "odd.safetensors"
    save_file(
        {"transformer.norm_out.linear.lokr_w1": rand(1, 4), "transformer.norm_out.linear.lokr_w2": rand(128, 16)},
        str(odd),
    )
    with pytest.raises(FluxKleinError, match=r"cannot be written on BFL's \[shift ; scale\] order .*1 rows"):
        convert_lora(odd, tmp_path / "odd-comfyui.safetensors", "comfyui")
    assert not (tmp_path / "odd-comfyui.safetensors").exists()


@pytest.mark.parametrize(
    "writer", ["lora_a", "lora_bfl", "lora_kohya", "mflux_file", "swift_file", "single_split_file"]
)
def test_convert_keeps_every_update_of_every_format_read(tmp_path, writer):
    """Every trainer's file (test_lora.py's writers, each checked against diffusers there) into each layout:
    the same update on every layer, q/k/v and split single-block rows, globals and the final layer included."""
    import test_lora

    from flux_klein_mlx.lora.convert import convert_lora

    source = tmp_path / "source.safetensors"
    getattr(test_lora, writer)(source, test_lora.Rand(21))
    want = dense_updates(source)
    for layout in LAYOUTS:
        got = dense_updates(convert_lora(source, tmp_path / f"{layout}.safetensors", layout))
        assert got.keys() == want.keys(), layout
        for layer, delta in want.items():
            assert np.abs(got[layer] - delta).max() <= 1e-6 * max(1.0, np.abs(delta).max()), (layout, layer)
