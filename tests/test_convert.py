"""`convert`: a tiny random snapshot in the Hugging Face layout -> MLX folder -> loaded models that
match the diffusers/transformers references; the BFL single file; atomic writes and bad inputs. Written once
for both families: a folder converted from the snapshot or its BFL file gives diffusers' image; a truncated
BFL file is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from command_line import assert_one_line_error
from mlx.utils import tree_flatten
from refs import load_folder_component, load_one, rel_err, to_mx
from tiny_model import LATENT_CHANNELS, QWEN_HIDDEN, TRANSFORMER, write_bfl_transformer

import flux_klein_mlx
import flux_klein_mlx.storage.weights as weights_module
from flux_klein_mlx import __main__ as cli
from flux_klein_mlx.convert import convert_model
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.tokenizer import PromptTokenizer
from flux_klein_mlx.run.loading import COMPONENTS, FORMAT, describe
from flux_klein_mlx.run.loading import read_mlx_config as read_config
from flux_klein_mlx.storage.weights import (
    read_safetensors,
    read_weight_files,
    resolve_model,
    save_safetensors_sharded,
    save_safetensors_streaming,
)


@pytest.fixture(scope="module")
def converted(snapshot, tmp_path_factory) -> Path:
    """float32 conversion, shards forced small so the text encoder is split with an index."""
    out = tmp_path_factory.mktemp("mlx") / "klein-f32"
    convert_model(snapshot, out, dtype="float32", max_shard_bytes=8 << 20)
    return out


@pytest.fixture(scope="module")
def references(snapshot):
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    return (
        Flux2Transformer2DModel.from_pretrained(snapshot / "transformer").eval(),
        Qwen3ForCausalLM.from_pretrained(snapshot / "text_encoder").eval(),
        AutoencoderKLFlux2.from_pretrained(snapshot / "vae").eval(),
    )


def leftovers(output: Path) -> list[str]:
    """Temporary siblings a run may have left next to `output`."""
    return [p.name for p in output.parent.iterdir() if p.name.startswith(output.name + ".")]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- references ---------------------------------------------------------------------------------


def transformer_outputs(ours, reference, seed=0):
    from diffusers import Flux2KleinPipeline

    g = torch.Generator().manual_seed(seed)
    C, Lt = TRANSFORMER["in_channels"], 12
    txt = torch.randn(1, Lt, TRANSFORMER["joint_attention_dim"], generator=g)
    txt_ids = Flux2KleinPipeline._prepare_text_ids(txt)
    img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(1, C, 4, 6))
    img = torch.randn(1, img_ids.shape[1], C, generator=g)
    t = torch.tensor([0.7])
    with torch.no_grad():
        theirs = reference(
            hidden_states=img,
            encoder_hidden_states=txt,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )[0]
    mine = ours(to_mx(img), to_mx(txt), to_mx(t), to_mx(img_ids), to_mx(txt_ids))
    return mine, theirs


def text_encoder_outputs(ours, reference, tokenizer_dir):
    tok = PromptTokenizer.from_folder(tokenizer_dir)
    ids, mask = tok(["a red fox in the snow", "x"], max_length=24)
    with torch.no_grad():
        hs = reference(
            input_ids=torch.tensor(np.array(ids), dtype=torch.long),
            attention_mask=torch.tensor(np.array(mask), dtype=torch.long),
            output_hidden_states=True,
        ).hidden_states
    theirs = torch.cat([hs[9], hs[18], hs[27]], dim=-1)
    return ours(ids, mask), theirs


def vae_decode_outputs(ours, reference, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, LATENT_CHANNELS, 4, 4, generator=g)
    with torch.no_grad():
        theirs = reference.decode(z).sample.permute(0, 2, 3, 1)  # NCHW -> NHWC
    return ours.decode(to_mx(z.permute(0, 2, 3, 1))), theirs


# --- round trip -----------------------------------------------------------------------------------


def test_folder_layout_and_config(converted, snapshot):
    config = read_config(converted)
    assert config["format"] == FORMAT and config["format_version"] == 1
    assert config["variant"] == "other"  # tiny; the real presets give klein-4b / klein-9b
    assert config["is_distilled"] is True
    assert config["dtype"] == "float32"
    assert config["source"]["format"] == "diffusers" and config["source"]["path"] == str(snapshot)
    assert all(config[n]["quantization"] is None for n in COMPONENTS)
    assert config["transformer"]["config"]["joint_attention_dim"] == 3 * QWEN_HIDDEN
    assert config["text_encoder"]["config"]["num_hidden_layers"] == 28
    assert config["vae"]["config"]["latent_channels"] == LATENT_CHANNELS
    assert config["scheduler"]["time_shift_type"] == "exponential"
    names = sorted(p.name for p in converted.iterdir())
    assert "transformer.safetensors" in names and "vae.safetensors" in names
    assert "text_encoder.safetensors.index.json" in names  # split by the small shard size
    assert sorted(n for n in names if n.startswith("text_encoder-")) == [
        "text_encoder-00001-of-00002.safetensors",
        "text_encoder-00002-of-00002.safetensors",
    ]
    assert sorted(p.name for p in (converted / "tokenizer").iterdir()) == sorted(
        p.name for p in (snapshot / "tokenizer").iterdir()
    )
    assert leftovers(converted) == []


def test_weights_are_ours_and_equal_to_direct_loading(converted, snapshot):
    """Keys are our model's names (no mapping at load) and every tensor equals the source loaders' result."""
    direct = {
        "transformer": load_one("transformer", snapshot / "transformer", dtype=mx.float32),
        "text_encoder": load_one("text_encoder", snapshot, dtype=mx.float32),
        "vae": load_one("vae", snapshot, dtype=mx.float32),
    }
    for name in COMPONENTS:
        loaded = dict(tree_flatten(load_folder_component(converted, name).parameters()))
        expected = dict(tree_flatten(direct[name].parameters()))
        assert loaded.keys() == expected.keys(), name
        for k, v in expected.items():
            assert loaded[k].dtype == mx.float32
            assert mx.array_equal(loaded[k], v).item(), (name, k)
    # Only layers 1..27 of the 28-layer Qwen3 are stored; its final norm / lm_head are not.
    stored = read_weight_files(sorted(converted.glob("text_encoder-*.safetensors")))
    assert not any(k.startswith("model.layers.27.") or k.startswith(("model.norm", "lm_head")) for k in stored)


def test_loaded_models_match_references(converted, references):
    transformer, text_encoder, vae = (load_folder_component(converted, n) for n in COMPONENTS)
    tokenizer_dir = describe(converted).tokenizer
    ref_t, ref_te, ref_vae = references
    errs = {
        "transformer": rel_err(*transformer_outputs(transformer, ref_t)),
        "text_encoder": rel_err(*text_encoder_outputs(text_encoder, ref_te, tokenizer_dir)),
        "vae": rel_err(*vae_decode_outputs(vae, ref_vae)),
    }
    assert max(errs.values()) < 1e-4, errs


def test_bf16_default_via_cli(capsys, snapshot, references, tmp_path):
    out = tmp_path / "klein-bf16"
    code, stdout, err = run_cli(capsys, "convert", "--model", str(snapshot), "--output", str(out))
    assert code == 0, err
    assert str(out) in stdout and "bfloat16" in stdout
    config = read_config(out)
    assert config["dtype"] == "bfloat16"
    stored = read_safetensors(out / "transformer.safetensors")
    assert {v.dtype for v in stored.values()} == {mx.bfloat16}
    transformer = load_folder_component(out, "transformer", dtype="float32")
    assert rel_err(*transformer_outputs(transformer, references[0])) < 2e-2  # bf16 weights


def test_bfl_single_file(snapshot, converted, tmp_path):
    """A BFL file next to a diffusers snapshot converts to exactly the same transformer."""
    src = tmp_path / "snap"
    shutil.copytree(snapshot, src)
    bfl = write_bfl_transformer(src)
    shutil.rmtree(src / "transformer")  # the file alone must be enough; config comes from its shapes
    out = tmp_path / "from-bfl"
    config = convert_model(bfl, out, dtype="float32")
    assert config["source"]["format"] == "bfl" and config["source"]["base"] == str(src)
    assert config["is_distilled"] is True
    a = read_safetensors(out / "transformer.safetensors")
    b = read_safetensors(converted / "transformer.safetensors")
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)

    # A Base checkpoint keeps is_distilled false whatever the base snapshot says.
    base_file = bfl.with_name("flux-2-klein-base-4b.safetensors")
    bfl.rename(base_file)
    assert convert_model(base_file, tmp_path / "base", dtype="float32")["is_distilled"] is False

    # Alone in a folder, it needs --base.
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(base_file, lone / base_file.name)
    with pytest.raises(FluxKleinError, match="--base"):
        convert_model(lone / base_file.name, tmp_path / "x")
    config = convert_model(lone / base_file.name, tmp_path / "with-base", dtype="float32", base=src)
    assert config["source"]["base"] == str(src)


@pytest.mark.parametrize("source", ["folder", "bfl"])
def test_convert_writes_a_folder_that_generates_diffusers_image(family, family_distilled, tmp_path, cli, source):
    """Each family's snapshot, or its transformer as a BFL file (ComfyUI's `model.diffusion_model.` names) with
    the snapshot as --base: `convert` writes a folder of that family whose image is diffusers' (1e-3)."""
    model, extra = family_distilled, []
    if source == "bfl":
        model = family.write_bfl(family_distilled, tmp_path / "model.safetensors", prefix="model.diffusion_model.")
        extra = ["--base", family_distilled]
    out = tmp_path / "mlx"
    code, _, err = cli("convert", "--model", model, *extra, "--output", out, "--dtype", "float32")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["family"] == family.name and config["is_distilled"]
    assert not any(p.suffix == ".safetensors" for p in (out / "tokenizer").iterdir())  # the tokenizer alone
    lat = np.random.default_rng(5).standard_normal((1, 32, 4, 4)).astype(np.float32)
    converted = flux_klein_mlx.load(out, dtype="float32", cache=False)
    assert converted.info.name == family.title
    ours = converted.generate("a lighthouse", steps=2, width=64, height=64, latents=lat, output_type="np")
    theirs = family.reference_image(family_distilled, prompt="a lighthouse", latents=lat, steps=2)
    assert np.abs(ours - theirs).max() <= 1e-3


def test_a_truncated_bfl_file_is_one_line(family, family_distilled, tmp_path, cli):
    file = family.write_bfl(family_distilled, tmp_path / "model.safetensors")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    code, _, err = cli("convert", "--model", file, "--base", family_distilled, "--output", tmp_path / "out")
    assert_one_line_error(code, err, str(file))
    assert not (tmp_path / "out").exists()


def test_base_snapshot_is_not_distilled(snapshot, tmp_path):
    src = tmp_path / "base-snap"
    shutil.copytree(snapshot, src)
    index = json.loads((src / "model_index.json").read_text())
    index.pop("is_distilled")  # as in black-forest-labs/FLUX.2-klein-base-4B
    (src / "model_index.json").write_text(json.dumps(index))
    assert convert_model(src, tmp_path / "out", dtype="float32")["is_distilled"] is False


def test_repo_id_through_the_hub_cache(snapshot, tmp_path, monkeypatch):
    """Offline, a repo id resolves from the Hugging Face cache, the path a user's first run takes."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-klein"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    os.symlink(snapshot, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model("acme/tiny-klein") == repo / "snapshots" / commit
    config = convert_model("acme/tiny-klein", tmp_path / "out", dtype="float32")
    assert config["source"]["model"] == "acme/tiny-klein"
    with pytest.raises(
        FluxKleinError,
        match=r"'acme/not-cached' is not in the local Hugging Face cache \(.*\) and "
        "HF_HUB_OFFLINE is set",
    ):
        resolve_model("acme/not-cached")
    with pytest.raises(FluxKleinError, match="not found"):
        resolve_model("./no/such/folder")


# --- the streaming writer ---------------------------------------------------------------------------


def test_streaming_writer_is_standard_and_holds_one_tensor(tmp_path):
    from safetensors.torch import load_file

    src = {f"w{i}": mx.random.normal((512, 512), key=mx.random.key(i)) for i in range(16)}  # 1 MB each
    src["packed"] = mx.array([[1, 2**32 - 1]], dtype=mx.uint32)
    src["flag"] = mx.array([True, False])
    mx.eval(src)
    mx.save_safetensors(str(tmp_path / "src.safetensors"), src)
    lazy = read_safetensors(tmp_path / "src.safetensors")
    out = {k: (v.astype(mx.bfloat16).T if v.dtype == mx.float32 else v) for k, v in lazy.items()}
    del lazy
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    save_safetensors_streaming(tmp_path / "out.safetensors", out, metadata={"format": "mlx"})
    assert out == {}  # consumed
    # 16 MB of float32 sources, 8 MB of output: one 1 MB source + its 0.5 MB output at a time.
    assert mx.get_peak_memory() - base < 4 << 20
    theirs = load_file(str(tmp_path / "out.safetensors"))  # the reference reader accepts the file
    for k, v in src.items():
        expected = torch.from_numpy(np.array(v.astype(mx.float32) if v.dtype == mx.float32 else v))
        if v.dtype == mx.float32:
            expected = expected.to(torch.bfloat16).T
        assert torch.equal(theirs[k], expected.to(theirs[k].dtype)), k


def test_sharded_writer_index(tmp_path):
    w = {f"t{i}": mx.full((256, 256), float(i)) for i in range(5)}  # 256 KB each
    files = save_safetensors_sharded(w, tmp_path, prefix="part", max_shard_bytes=600 << 10)
    assert [f.name for f in files] == [f"part-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "part.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 256 * 256 * 4
    back = read_weight_files(files)
    assert sorted(back) == [f"t{i}" for i in range(5)] and all(back[f"t{i}"][0, 0].item() == i for i in range(5))


# --- bad input ----------------------------------------------------------------------------------------


def test_existing_output_refused_then_overwritten(capsys, snapshot, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    code, _, err = run_cli(capsys, "convert", "-m", str(snapshot), "-o", str(out), "--dtype", "float32")
    assert code == 1 and err.count("\n") == 1 and "already exists; pass --overwrite" in err
    assert (out / "keep.txt").read_text() == "old"
    # --overwrite replaces only a folder `convert` wrote (issue 12: a folder of documents was wiped).
    code, _, err = run_cli(capsys, "convert", "-m", str(snapshot), "-o", str(out), "--dtype", "float32", "--overwrite")
    assert code == 1 and err.count("\n") == 1 and "not a folder written by `flux_klein_mlx convert`" in err
    assert (out / "keep.txt").read_text() == "old" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    ours = tmp_path / "ours"
    code, _, err = run_cli(capsys, "convert", "-m", str(snapshot), "-o", str(ours), "--dtype", "bfloat16")
    assert code == 0, err
    (ours / "keep.txt").write_text("old")
    code, _, err = run_cli(capsys, "convert", "-m", str(snapshot), "-o", str(ours), "--dtype", "float32", "--overwrite")
    assert code == 0, err
    assert not (ours / "keep.txt").exists() and read_config(ours)["dtype"] == "float32"
    assert leftovers(ours) == []


def test_incomplete_or_damaged_source(capsys, snapshot, tmp_path):
    src = tmp_path / "snap"
    shutil.copytree(snapshot, src)
    out = tmp_path / "out"
    shutil.rmtree(src / "transformer")
    shutil.rmtree(src / "vae")  # model_index.json alone is not a model
    code, _, err = run_cli(capsys, "convert", "-m", str(src), "-o", str(out))
    assert code == 1 and err.count("\n") == 1 and "transformer" in err and "incomplete" in err
    assert not out.exists() and leftovers(out) == []

    shutil.copytree(snapshot / "transformer", src / "transformer")
    shutil.copytree(snapshot / "vae", src / "vae")
    shard = src / "text_encoder" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # an interrupted download
    code, _, err = run_cli(capsys, "convert", "-m", str(src), "-o", str(out))
    assert code == 1 and err.count("\n") == 1 and "damaged" in err and shard.name in err
    assert not out.exists() and leftovers(out) == []

    shard.unlink()
    code, _, err = run_cli(capsys, "convert", "-m", str(src), "-o", str(out))
    assert code == 1 and "missing shard" in err and not out.exists()


def test_interrupted_run_leaves_nothing(snapshot, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real, calls = weights_module._tensor_bytes, []

    def interrupt_midway(a):
        calls.append(1)
        if len(calls) == 40:  # well into the transformer file
            raise KeyboardInterrupt
        return real(a)

    monkeypatch.setattr(weights_module, "_tensor_bytes", interrupt_midway)
    with pytest.raises(KeyboardInterrupt):
        convert_model(snapshot, out)
    assert not out.exists() and leftovers(out) == []

    # The same interruption while replacing an existing folder keeps the old one intact.
    out.mkdir()
    (out / "keep.txt").write_text("old")
    (out / "config.json").write_text('{"format": "flux_klein_mlx"}')  # --overwrite replaces only our folders
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        convert_model(snapshot, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "old" and leftovers(out) == []


def test_too_little_disk_space(capsys, snapshot, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 10**6, 10**6))
    code, _, err = run_cli(capsys, "convert", "-m", str(snapshot), "-o", str(out))
    assert code == 1 and err.count("\n") == 1 and "not enough disk space" in err and "GB" in err
    assert not out.exists() and leftovers(out) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quantize", "3"], "cannot quantize to 3 bits; choose 4 or 8"),
        (["--quantize", "4", "--group-size", "48"], "group size 48 is not supported"),
        (["--dtype", "float64"], "Invalid value for '--dtype'"),
    ],
)
def test_bad_options(capsys, snapshot, tmp_path, args, message):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", "-m", str(snapshot), "-o", str(out), *args)
    assert code != 0 and message in err and "Traceback" not in err
    assert not out.exists()


def test_bad_model_arguments(capsys, snapshot, converted, tmp_path):
    code, _, err = run_cli(capsys, "convert", "-m", "acme/does-not-exist", "-o", str(tmp_path / "o"))
    assert code == 1 and "is not in the local Hugging Face cache" in err
    code, _, err = run_cli(capsys, "convert", "-m", str(converted), "-o", str(tmp_path / "o"))
    assert code == 1 and "already converted" in err
    code, _, err = run_cli(capsys, "convert", "-m", str(tmp_path), "-o", str(tmp_path / "o"))
    assert code == 1 and "not a FLUX.2 [klein] snapshot" in err
    code, _, err = run_cli(capsys, "convert", "-m", str(snapshot), "-o", str(snapshot / "mlx"))
    assert code == 1 and "inside the source" in err and not (snapshot / "mlx").exists()


def test_cli_subprocess_one_line_no_traceback(snapshot, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-m", "flux_klein_mlx", "convert", "--model", str(snapshot), "--output", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
    )
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr and "already exists" in r.stderr
