"""Issue 22 in the pipeline and at its doors: a cached prompt gives the same image without ever
opening the text encoder's files; `--no-cache`, `--cache-size`, `--vae`; the read-ahead of the
next model's files; `benchmark --cold`.

The cache and the read-ahead themselves are tested in test_embedding_cache.py / test_readahead.py;
the judge of the images here is the miss (which test_pipeline.py holds against diffusers).
"""

from __future__ import annotations

import shutil
import socket
import threading

import numpy as np
import pytest
from command_line import gen_args
from file_opens import FileOpens
from refs import noise

import flux_klein_mlx
import flux_klein_mlx.run.pipeline as pipeline_module
from flux_klein_mlx.__main__ import main
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.record.output import read_record
from flux_klein_mlx.run.loading import describe


@pytest.fixture
def loads(monkeypatch):
    """The names of the components loaded (every load goes through pipeline.load_component)."""
    names, real = [], pipeline_module.load_component
    monkeypatch.setattr(
        pipeline_module, "load_component", lambda info, name, *a, **k: names.append(name) or real(info, name, *a, **k)
    )
    return names


def encoder_files(snapshot):
    return describe(snapshot).files["text_encoder"]


def test_a_cached_prompt_gives_the_same_image_and_never_opens_the_text_encoder(distilled, loads, monkeypatch):
    lat = noise(64, 64)
    args = dict(width=64, height=64, steps=1, latents=lat, output_type="np")
    with FileOpens(encoder_files(distilled), monkeypatch) as first:
        pipe = flux_klein_mlx.load(distilled, dtype="float32")
        pipe.prefetch.enabled = True  # on by default where a GPU computes
        miss = pipe.generate("a red fox", **args)
    assert "text_encoder" in loads and first.opened  # the recorder sees the opens of a miss
    assert set(pipe.prefetch.finished) == {"transformer", "vae"}  # read while the encoder ran, and the step
    loads.clear()
    with FileOpens(encoder_files(distilled), monkeypatch) as opens:  # a new pipeline: as a second `generate`
        pipe = flux_klein_mlx.load(distilled, dtype="float32")
        pipe.prefetch.enabled = True  # on by default where a GPU computes
        hit = pipe.generate("a red fox", **args)
    assert opens.opened == [] and loads == ["transformer", "vae"] and not pipe.is_loaded("tokenizer")
    assert np.array_equal(hit, miss)  # bit for bit
    # The next model's files were read ahead while the previous one computed, and the readers are gone.
    assert set(pipe.prefetch.finished) == {"transformer", "vae"}
    assert all(s.error is None for s in pipe.prefetch.finished.values())
    assert not any(t.name.startswith("flux_klein_mlx-read") for t in threading.enumerate())
    loads.clear()
    off = flux_klein_mlx.load(distilled, dtype="float32", cache=False).generate("a red fox", **args)
    assert "text_encoder" in loads and np.array_equal(off, miss)


def test_second_generate_with_another_seed_skips_the_encoder_in_the_default_dtype(distilled, loads, tmp_path, capsys):
    """`generate` twice with the same prompt (bfloat16, the default): the second run neither loads
    nor checks the encoder; --no-cache runs it again; the record names the VAE (none given: null)."""
    base = ["generate", "-m", str(distilled), "-p", "a boat", "-W", "64", "-H", "64", "--steps", "1"]
    assert main(base + ["--seed", "1", "-o", str(tmp_path / "a.png")]) == 0
    first = capsys.readouterr().err
    assert "text_encoder" in loads and "prompt embeddings cached" not in first
    loads.clear()
    assert main(base + ["--seed", "2", "-o", str(tmp_path / "b.png")]) == 0
    assert "prompt embeddings cached" in capsys.readouterr().err and "text_encoder" not in loads
    loads.clear()
    assert main(base + ["--seed", "2", "--no-cache", "-o", str(tmp_path / "c.png")]) == 0
    assert "text_encoder" in loads
    assert read_record(tmp_path / "b.png")["vae"] is None


def test_a_changed_encoder_file_is_never_served_stale_and_a_damaged_one_is_refused_first(
    distilled, tmp_path, capsys, loads
):
    snap = tmp_path / "snap"
    shutil.copytree(distilled, snap)
    args = gen_args(str(snap), str(tmp_path / "x.png"))
    assert main(args) == 0
    capsys.readouterr()
    shard = encoder_files(snap)[0]
    shard.write_bytes(shard.read_bytes()[:-1000])  # truncated after its prompt was cached
    loads.clear()
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "is truncated" in err, err
    assert loads == []  # refused before any model loaded, and the cached embeddings were not used


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--cache-size", "lots"], "cache size must be a number of bytes"),
        (["--cache-size", "-1GB"], "cache size must be a number of bytes"),
        (["--vae", "/no/such/vae"], "not found"),
        (["--vae", "{vae_txt}"], "is not a .safetensors file"),
        (["--vae", "{snapshot}/tokenizer"], "has no VAE"),
    ],
)
def test_bad_cache_and_vae_options_are_one_line_before_any_model(distilled, tmp_path, cli, loads, extra, words):
    txt = tmp_path / "vae.txt"
    txt.write_text("not a VAE")
    extra = [e.format(vae_txt=txt, snapshot=distilled) for e in extra]
    out = tmp_path / "x.png"
    code, _, err = cli("generate", "-m", str(distilled), "-p", "x", "-W", "64", "-H", "64", "-o", str(out), *extra)
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert words in err and loads == [] and not out.exists()
    if extra[0] == "--vae":  # the server: one line and exit 1 before it says "serving"
        pytest.importorskip("uvicorn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        code, _, err = cli("serve", "--model", str(distilled), "--port", str(port), *extra)
        assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and words in err, err


def test_bad_load_arguments(distilled):
    for kwargs, words in (
        (dict(cache="yes"), "cache must be True, False or an EmbeddingCache"),
        (dict(cache_size="huge"), "cache size must be a number of bytes"),
        (dict(vae=3), "vae must be a repo id or a path"),
    ):
        with pytest.raises(FluxKleinError, match=words):
            flux_klein_mlx.load(distilled, **kwargs)
    assert flux_klein_mlx.load(distilled, cache_size=0).cache is None  # 0 turns it off
    assert flux_klein_mlx.load(distilled, cache_size="2GB").cache.max_bytes == 2 * 10**9


def test_benchmark_cold_reports_every_run_and_the_limit(distilled, capsys, tmp_path):
    code = main(
        [
            "benchmark",
            "--cold",
            "-m",
            str(distilled),
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1",
            "--dtype",
            "float32",
            "--json",
            str(tmp_path / "cold.json"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    for words in (
        "sequential read of those bytes",
        "| text encoder load |",
        "| **total** |",
        "cold: ",
        "bytes / rate + warm compute",
        "second run (same prompt, another seed)",
    ):
        assert words in out, (words, out)
    import json

    r = json.loads((tmp_path / "cold.json").read_text())
    assert set(r["runs"]) == {"cold", "cold, no read-ahead", "warm", "second", "cold, cached"}
    assert "text encoder load" not in r["runs"]["second"]["stages"]  # the cached prompt: no encoder
    assert r["bytes"]["text_encoder"] == sum(s.nbytes for s in _spans(distilled))
    code = main(["benchmark", "--cold", "--random-weights"])
    assert code != 0 and "--cold and --vae need --model" in capsys.readouterr().err


def _spans(snapshot):
    from flux_klein_mlx.storage.readahead import component_spans

    return component_spans(describe(snapshot), "text_encoder", merge=False)


@pytest.mark.parametrize("dtype, bits", [("bfloat16", None), ("float32", 4)])
def test_a_cast_or_quantized_load_never_holds_the_whole_source(distilled, dtype, bits):
    """Loading float32 files as bf16 (or quantizing at load) holds one layer's source tensors at a
    time, not the whole model's: the peak stays near the loaded size (before: loaded + source)."""
    import mlx.core as mx

    from flux_klein_mlx.dtypes import as_dtype
    from flux_klein_mlx.run.components import load_component

    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    model = load_component(describe(distilled), "transformer", as_dtype(dtype), quantize=bits)
    loaded = mx.get_active_memory() - before
    assert mx.get_peak_memory() - before < 1.5 * loaded, (mx.get_peak_memory() - before, loaded)
    del model
