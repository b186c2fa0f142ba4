"""A model refused before anything loads (issues 12, 30): loading.py's checks and convert's sources.

A damaged, truncated, foreign or unsupported model (a text file, a FLUX.1 index, FLUX 3 Image Klein) and
options that do not fit it (`--quantize` on a quantized folder, `--base` beside a whole snapshot): one
clear line each, exit 1, no model loaded (`no_models`), nothing changed or written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from command_line import assert_one_line_error, free_port, gen_args, tree_hash
from PIL import Image

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.run.pipeline import load


def damaged_copy(snapshot, tmp_path, how):
    src = tmp_path / "snap"
    shutil.copytree(snapshot, src)
    vae = src / "vae" / "diffusion_pytorch_model.safetensors"
    data = vae.read_bytes()
    if how == "truncated":
        vae.write_bytes(data[: len(data) - 1000])
    elif how == "garbage":
        vae.write_bytes(b"\x00" * 64)
    elif how == "shape":
        cfg = json.loads((src / "vae" / "config.json").read_text())
        cfg["block_out_channels"] = [16, 16, 32, 48]
        (src / "vae" / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("how,words", [("truncated", "is truncated"), ("garbage", "damaged"), ("shape", "VAE weight")])
def test_damaged_vae_found_before_any_model(cli, snapshot, tmp_path, no_models, how, words):
    src = damaged_copy(snapshot, tmp_path, how)
    before = tree_hash(src)
    code, _, err = cli(*gen_args(src, tmp_path / "x.png"))
    assert_one_line_error(code, err, words)
    code, _, err = cli("convert", "-m", src, "-o", tmp_path / "out")
    assert_one_line_error(code, err, words)
    assert no_models == [] and tree_hash(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]


def test_truncated_converted_folder_refused_before_any_model(cli, converted_snapshot, tmp_path, no_models):
    out = tmp_path / "conv"
    shutil.copytree(converted_snapshot, out)
    f = out / "transformer.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    code, _, err = cli(*gen_args(out, tmp_path / "x.png"))
    assert_one_line_error(code, err, "transformer.safetensors is truncated")
    code, _, err = cli("quantize", "-m", out, "-b", "4", "-o", tmp_path / "q")
    assert_one_line_error(code, err, "is truncated")
    assert not (tmp_path / "q").exists() and not (tmp_path / "x.png").exists()


def test_load_message_says_what_is_true(cli, snapshot, tmp_path):
    code, _, err = cli(*gen_args(snapshot, tmp_path / "x.png"))
    assert code == 0, err
    assert "loaded in" not in err and "models load on first use" in err


def test_text_file_as_model(cli, tmp_path, no_models):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    code, _, err = cli(*gen_args(notes, tmp_path / "x.png"))
    assert_one_line_error(code, err, "is not a .safetensors file")


def test_flux1_index_refused_by_convert_as_by_generate(cli, snapshot, tmp_path, no_models):
    src = tmp_path / "snap"
    shutil.copytree(snapshot, src)
    index = json.loads((src / "model_index.json").read_text())
    index["_class_name"] = "FluxPipeline"
    (src / "model_index.json").write_text(json.dumps(index))
    code, _, err_gen = cli(*gen_args(src, tmp_path / "x.png"))
    assert_one_line_error(code, err_gen, "FluxPipeline")
    code, _, err_conv = cli("convert", "-m", src, "-o", tmp_path / "out")
    assert_one_line_error(code, err_conv, "FluxPipeline")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]


def test_quantize_option_on_a_quantized_folder(cli, snapshot, tmp_path, no_models):
    q4 = tmp_path / "q4"
    code, _, err = cli("convert", "-m", snapshot, "-o", q4, "-q", "4")
    assert code == 0, err
    code, _, err = cli(*gen_args(q4, tmp_path / "x.png", "--quantize", "8"))
    assert_one_line_error(code, err, "already quantized to 4 bits")
    load(q4, quantize=4)  # the same bits: nothing to do, accepted


def test_load_arguments_refused_by_the_python_api(snapshot, no_models):
    for kwargs, words in [
        (dict(model=None), "model must be a repo id or a path"),
        (dict(model=3), "model must be a repo id or a path"),
        (dict(model=snapshot, quantize="4"), "quantize must be a whole number"),
        (dict(model=snapshot, quantize=True), "quantize must be a whole number"),
        (dict(model=snapshot, dtype=1), "dtype must be one of"),
    ]:
        with pytest.raises(FluxKleinError, match=words):
            load(**kwargs)
    assert no_models == []


def test_convert_base_beside_a_whole_snapshot_is_refused(cli, snapshot, tmp_path):
    """`--base` beside a whole snapshot would be ignored: refused, nothing written."""
    code, _, err = cli("convert", "-m", snapshot, "--base", snapshot, "-o", tmp_path / "out")
    assert_one_line_error(code, err, "--base is only for a single-file transformer")
    assert list(tmp_path.iterdir()) == []


def test_convert_says_a_kv_flag_came_from_the_base(cli, snapshot, tmp_path):
    """A BFL transformer converted with a 9B-KV snapshot as --base says that its KV flag came from that base."""
    from tiny_model import write_bfl_transformer

    kv_base = tmp_path / "kv-base"
    shutil.copytree(snapshot, kv_base)
    index = json.loads((kv_base / "model_index.json").read_text())
    index["_class_name"] = "Flux2KleinKVPipeline"
    index.pop("is_distilled", None)
    (kv_base / "model_index.json").write_text(json.dumps(index))
    lone = tmp_path / "lone"
    lone.mkdir()
    bfl = write_bfl_transformer(kv_base)
    bfl = bfl.rename(lone / bfl.name)
    code, out, err = cli("convert", "-m", bfl, "--base", kv_base, "-o", tmp_path / "kv", "--dtype", "float32")
    assert code == 0, err
    assert f"reference KV because its base {kv_base} is a Flux2KleinKVPipeline" in out
    assert json.loads((tmp_path / "kv" / "config.json").read_text())["reference_kv"] is True


# --- FLUX 3 Image Klein (issue 30) -------------------------------------------------------------------------


def flux3_folder(snapshot, folder: Path, index: str) -> Path:
    """A diffusers FLUX 3 Image Klein folder as diffusers writes one: the pipeline's index and the transformer's
    config (Flux3Transformer2DModel, 24 heads x 128 = 3072 wide, as klein-4B); the text encoder, VAE and
    tokenizer folders are the tiny snapshot's so that nothing else is missing."""
    shutil.copytree(snapshot, folder, ignore=shutil.ignore_patterns("model_index.json", "transformer"))
    if index == "modular":  # a modular pipeline's own index (Flux3DistilledModularPipeline)
        (folder / "modular_model_index.json").write_text(json.dumps({"_class_name": "Flux3DistilledModularPipeline"}))
    else:  # an index that claims klein: only the transformer's class tells
        index = {"_class_name": "Flux2KleinPipeline", "is_distilled": True}
        (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(
        json.dumps(
            {
                "_class_name": "Flux3Transformer2DModel",
                "in_channels": 128,
                "cond_in_channels": 128,
                "num_layers": 5,
                "num_single_layers": 28,
                "attention_head_dim": 128,
                "num_attention_heads": 24,
                "joint_attention_dim": 20480,
                "flow_map": True,
            }
        )
    )
    return folder


def flux3_file(path: Path) -> Path:
    """A BFL FLUX 3 Image Klein transformer file: BFL's key names (the ones diffusers' single-file loader tells
    FLUX 3 by), the image embedding klein-4B's width (3072); the other tensors cut down to stay small."""
    from safetensors.numpy import save_file

    small = np.zeros((4, 4), np.float16)
    save_file(
        {
            "emb_in.image.weight": np.zeros((3072, 128), np.float16),
            "early_stream_modulations.image.lin.weight": small,
            "ref_time_in.in_layer.weight": small,
            "content_mode_blocks.image.0.q_proj.weight": small,
            "single_blocks.0.q_proj.weight": small,
            "txt_in.weight": small,
        },
        str(path),
    )
    return path


def test_flux3_image_klein_is_never_taken_for_flux2(cli, snapshot, tmp_path, no_models):
    """FLUX 3 Image Klein runs now (tests/test_pipeline.py), but parts of it mixed with FLUX.2's must
    still be told apart by name, never by shape (its hidden size is klein-4B's): a FLUX 3 transformer in a
    folder with FLUX.2's text encoder (modular index), one under a klein index, and a BFL FLUX 3 file with no
    FLUX 3 folder beside it. `generate`, `convert`, `train`, `benchmark` and `serve` each name FLUX 3 Image
    Klein in one line (never "FLUX.2 [klein] 4B"), exit 1, load no model and write nothing."""
    sources = [
        flux3_folder(snapshot, tmp_path / "flux3-modular", "modular"),
        flux3_folder(snapshot, tmp_path / "flux3-indexed", "klein"),
        flux3_file(tmp_path / "flux-3-image-klein.safetensors"),
    ]
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 64), (20, 40, 60)).save(data / "a.png")
    (data / "a.txt").write_text("a card")
    before = tree_hash(tmp_path)
    for src in sources:
        commands = [
            gen_args(src, tmp_path / "x.png"),
            ["convert", "-m", src, "-o", tmp_path / "out"],
            ["benchmark", "--model", src, "--steps", "1", "-W", "64", "-H", "64"],
            ["serve", "--model", src, "--port", free_port()],
        ]
        if src.is_dir():  # `train --model FILE` is refused for being a file (train needs a Base folder or repo id)
            commands.append(["train", "--model", src, "--data", data, "--output", tmp_path / "l.safetensors"])
        for args in commands:
            code, _, err = cli(*args)
            assert_one_line_error(code, err, "FLUX 3 Image Klein")
            assert src.name in err and "[klein] 4B" not in err.replace("FLUX.2 [klein] 4B/9B", ""), (args[0], err)
    assert no_models == [] and tree_hash(tmp_path) == before


def test_a_bfl_file_loads_without_convert_on_its_base_folder(family, family_base, tmp_path):
    from flux_klein_mlx.run.loading import describe

    file = family.write_bfl(family_base, tmp_path / f"{family.name}-base.safetensors")
    info = describe(file, base=family_base)
    assert info.format == "bfl" and info.family.key == family.name and not info.is_distilled
    assert info.name == family.title + " Base"


def test_a_flux3_transformer_with_a_flux2_base_folder_is_one_line(distilled3, snapshot, tmp_path):
    from tiny_flux3 import write_bfl_flux3_file

    from flux_klein_mlx.run.loading import describe

    file = write_bfl_flux3_file(distilled3, tmp_path / "model.safetensors")
    with pytest.raises(FluxKleinError, match="is a FLUX 3 Image Klein transformer but .* is not a FLUX 3"):
        describe(file, base=snapshot)
