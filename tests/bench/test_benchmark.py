"""The benchmark: FLOP model against performance.md, the CLI end to end on a tiny model, and the
diffusers comparison on a tiny config (outputs must agree before a speed ratio means anything)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from flux_klein_mlx.bench import command as bm
from flux_klein_mlx.bench import flops
from flux_klein_mlx.bench.random_model import random_pipeline, randomize
from flux_klein_mlx.models.config import AutoEncoderConfig, Qwen3Config, Variant
from flux_klein_mlx.models.flux2.config import FluxKleinParams, qwen3_4b, qwen3_8b
from flux_klein_mlx.models.flux2.transformer import FluxKlein

ROOT = Path(__file__).resolve().parents[2]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- FLOP model: the numbers of docs/performance.md#the-flop-model ------------------------------

STEP_TFLOP = {  # (variant, side): (linear, attention, total per step)
    ("4b", 1024): (28.27, 6.52, 34.82),
    ("4b", 512): (9.42, 0.72, 10.17),
    ("9b", 1024): (64.32, 11.13, 75.51),
    ("9b", 512): (21.44, 1.24, 22.73),
}


@pytest.mark.parametrize("variant,side", list(STEP_TFLOP))
def test_transformer_step_flops_match_performance_doc(variant, side):
    params = FluxKleinParams.klein_4b() if variant == "4b" else FluxKleinParams.klein_9b()
    f = flops.flops_of_transformer(params, width=side, height=side)
    linear, attention, total = STEP_TFLOP[variant, side]
    assert f.total / 1e12 == pytest.approx(total, rel=1e-3)
    assert f.linear / 1e12 == pytest.approx(linear, rel=1e-3)
    assert f.attention / 1e12 == pytest.approx(attention, abs=0.005)  # the doc gives 2 decimals
    # The keyword form with the doc's shapes gives the same count.
    D, depth, single, ctx = (3072, 5, 20, 7680) if variant == "4b" else (4096, 8, 24, 12288)
    raw = flops.transformer_step_flops(
        hidden=D,
        depth=depth,
        depth_single=single,
        image_tokens=(side // 16) ** 2,
        text_tokens=512,
        mlp_ratio=3.0,
        context_dim=ctx,
    )
    assert raw == f


def test_text_encoder_and_vae_flops_match_performance_doc():
    assert flops.flops_of_text_encoder(qwen3_4b(), layers=27).total / 1e12 == pytest.approx(2.85, rel=2e-3)
    assert flops.flops_of_text_encoder(qwen3_4b(), layers=36).total / 1e12 == pytest.approx(3.80, rel=2e-3)
    assert flops.flops_of_text_encoder(qwen3_8b(), layers=27).total / 1e12 == pytest.approx(5.39, rel=2e-3)
    assert flops.flops_of_text_encoder(qwen3_8b(), layers=36).total / 1e12 == pytest.approx(7.19, rel=2e-3)
    vae = AutoEncoderConfig.flux2()
    big, small = flops.flops_of_vae_decoder(vae, 1024, 1024), flops.flops_of_vae_decoder(vae, 512, 512)
    assert big.total / 1e12 == pytest.approx(10.5, rel=5e-3)
    assert big.attention / 1e12 == pytest.approx(0.55, rel=5e-3)
    assert small.total / 1e12 == pytest.approx(2.5, rel=1e-2)
    assert small.attention / 1e12 == pytest.approx(0.034, rel=2e-2)


def test_whole_image_flops_and_lower_bounds_match_performance_doc():
    flops = _load_script("flops")
    p4, q4 = flops.variants()["klein-4B"]
    p9, q9 = flops.variants()["klein-9B"]
    assert flops.image_flops(p4, q4, 1024)["image"] == pytest.approx(152.6, rel=1e-3)
    assert flops.image_flops(p4, q4, 512)["image"] == pytest.approx(46.1, rel=1e-3)
    assert flops.image_flops(p9, q9, 1024)["image"] == pytest.approx(317.9, rel=1e-3)
    assert flops.image_flops(p9, q9, 512)["image"] == pytest.approx(98.8, rel=1e-3)
    # Section 0: lower bound per 1024² 4B step on an M4 Max (18.4 TFLOPS) and an M3 Max (14.2).
    step = flops.image_flops(p4, q4, 1024)["step"]
    assert step / flops.chip_peak_tflops("Apple M4 Max", 40) == pytest.approx(1.89, abs=0.005)
    assert step / flops.chip_peak_tflops("M3 Max") == pytest.approx(2.45, abs=0.005)
    assert "M4 Max (40c)" in flops.tables()


def test_chip_peaks():
    assert flops.chip_peak_tflops("Apple M2 Pro", 19) == pytest.approx(6.8)
    assert flops.chip_peak_tflops("Apple M4 Max", 32) == pytest.approx(18.4 * 32 / 40)  # binned part
    assert flops.chip_peak_tflops("Apple M3 Max", None) == pytest.approx(14.2)
    assert flops.chip_peak_tflops("Apple M9 Hyper", 99) is None
    assert flops.chip_peak_tflops(None) is None
    assert flops.chip_peak_tflops("Apple M1") == pytest.approx(2.6)  # "M1" does not match "M1 Max"


def test_machine_info_on_this_machine():
    info = flops.machine_info()
    for key in ("os", "python", "mlx", "flux_klein_mlx", "device", "cpu", "cpu_cores", "peak_tflops"):
        assert key in info
    if info["device"] == "cpu":
        assert info["peak_tflops"] is None  # the chip table holds GPU peaks only


# --- The benchmark on a tiny random model ---------------------------------------------------------

TINY_PARAMS = FluxKleinParams(
    hidden_size=64, num_heads=2, axes_dim=(8,) * 4, depth=1, depth_single=1, context_in_dim=96
)
TINY = Variant(
    name="tiny",
    title="tiny random klein",
    family="other",
    distilled=True,
    transformer=TINY_PARAMS,
    text_encoder=Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=27,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=1e6,
        vocab_size=1000,
    ),
    vae=AutoEncoderConfig(block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=32),
    steps=4,
    guidance=None,
)


def test_tiny_random_pipeline_end_to_end(tmp_path):
    r = bm.run_benchmark(random_pipeline(TINY), width=80, height=64, steps=2, warmup=1, trials=2)
    table = bm.format_report(r)
    for label in ("text encoding", "denoising step", "VAE decode", "image (no loads)", "make random transformer"):
        assert label in table
    out = bm.write_json(r, tmp_path / "bench.json")
    r = json.loads(out.read_text())
    assert (
        r["config"]
        | {
            "width": 80,
            "height": 64,
            "image_tokens": 20,
            "text_tokens": 512,
            "steps": 2,
            "warmup": 1,
            "trials": 2,
            "weights": "random",
            "dtype": "float32",
        }
        == r["config"]
    )
    st = r["stages"]
    assert len(st["denoise_step"]["times_s"]) == 2 * 2  # trials x steps, warm-up excluded
    assert len(st["denoise_step"]["per_step_median_s"]) == 2
    for name in ("text_encoding", "denoise_step", "denoise", "vae_decode"):
        s = st[name]
        assert s["min_s"] <= s["median_s"] <= s["max_s"]
        assert s["tflops"] > 0 and s["peak_memory_gb"] > 0
        assert s["pct_of_peak"] is None  # CPU: no chip peak
    for name in ("text_encoder_load", "transformer_load", "vae_load"):
        assert st[name]["seconds"] > 0 and st[name]["weights_gb"] > 0
    # The FLOP fields come from the same model as the library functions.
    assert r["flops"]["step_tflop"] == pytest.approx(
        flops.flops_of_transformer(TINY_PARAMS, width=80, height=64).total / 1e12
    )
    image = st["image"]
    assert image["seconds"] == pytest.approx(
        st["text_encoding"]["median_s"] + st["denoise"]["median_s"] + st["vae_decode"]["median_s"]
    )
    assert r["machine"]["mlx"] and r["machine"]["flux_klein_mlx"]


def denoise_only(snapshot) -> list[str]:
    """`benchmark` on the tiny model: 64x64, one step, one trial, no warmup, the denoise stage alone."""
    return [
        "--model",
        str(snapshot),
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--trials",
        "1",
        "--skip-text-encoder",
        "--skip-decode",
    ]


def test_cli_never_overwrites_json(snapshot, tmp_path, capsys):
    out = tmp_path / "bench.json"
    out.write_text("keep me")
    args = denoise_only(snapshot) + ["--json", str(out)]
    assert bm.main(args) == 0
    assert out.read_text() == "keep me"
    assert "wrote" in capsys.readouterr().err
    r = json.loads((tmp_path / "bench-1.json").read_text())
    assert "text_encoding" not in r["stages"] and "vae_decode" not in r["stages"]
    assert r["stages"]["image"]["includes"] == ["denoise"]


def test_cli_quantized(snapshot, tmp_path):
    base = denoise_only(snapshot)
    assert bm.main(base + ["--quantize", "4", "--json", str(tmp_path / "q.json")]) == 0
    assert bm.main(base + ["--json", str(tmp_path / "f.json")]) == 0
    q, f = (json.loads((tmp_path / n).read_text()) for n in ("q.json", "f.json"))
    assert q["config"]["quantize"] == 4 and f["config"]["quantize"] is None
    # Packed 4-bit weights + scales/biases are far smaller than the float32 weights of the same model.
    assert q["stages"]["transformer_load"]["weights_gb"] < 0.5 * f["stages"]["transformer_load"]["weights_gb"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "SNAPSHOT", "-W", "100"], "width 100 is not a multiple of 16; use e.g. 96 or 112"),
        (["--random-weights", "-H", "8"], "height 8 is below the minimum of 64 px"),
        (["--random-weights", "--variant", "klein-7b"], "klein-7b"),
        (["--variant", "klein-4b"], "--random-weights"),
        (["--model", "x", "--random-weights"], "not both"),
        (["--random-weights", "--json", "/nonexistent/dir/r.json"], "does not exist"),
        (["--model", "SNAPSHOT3", "-W", "100"], "width 100 is not a multiple of 16"),
        (["--model", "SNAPSHOT3", "--variant", "flux3-klein"], "--variant only applies to --random-weights"),
        (["--random-weights", "--variant", "flux3-klein", "--blocks", "5+x"], "5+28, its per-mode + single blocks"),
    ],
)
def test_cli_bad_options_are_one_line_errors(args, message, request, capsys):
    """SNAPSHOT / SNAPSHOT3: the tiny FLUX.2 / FLUX 3 snapshot."""
    folders = {"SNAPSHOT": "distilled", "SNAPSHOT3": "distilled3"}
    args = [str(request.getfixturevalue(folders[a])) if a in folders else a for a in args]
    assert bm.main(args) != 0
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


# --- MLX vs diffusers, tiny ---------------------------------------------------------------------


def test_compare_step_tiny_agrees_with_diffusers():
    bench = _load_script("bench_step")
    params = FluxKleinParams(hidden_size=64, num_heads=2, axes_dim=(8,) * 4, depth=2, depth_single=2, context_in_dim=40)
    model = bench.build_diffusers(params, "float32", seed=3)
    n_params = sum(p.numel() for p in model.parameters())
    r = bench.compare_step(model, width=48, height=32, text_tokens=24, warmup=1, trials=2, log=lambda m: None)
    assert r["rel_err"] < 1e-4
    assert r["config"]["image_tokens"] == 6 and r["config"]["double_blocks"] == 2
    assert len(r["mlx"]["times_s"]) == len(r["diffusers"]["times_s"]) == 2
    assert r["ratio_mlx_over_diffusers"] == pytest.approx(r["mlx"]["median_s"] / r["diffusers"]["median_s"])
    # The diffusers model was emptied while MLX took the weights: one copy resident at a time.
    assert n_params > 0 and sum(p.numel() for p in model.parameters()) == 0
    assert math.isfinite(r["tflop_per_step"])


def test_random_weights_are_scaled_and_in_dtype():
    model = FluxKlein(TINY_PARAMS)
    randomize(model, mx.bfloat16, seed=0)
    flat = dict(tree_flatten(model.parameters()))
    assert all(v.dtype == mx.bfloat16 for v in flat.values())
    w = flat["single_blocks.0.linear2.weight"].astype(mx.float32)  # (64, 64 + 192): std 1/sqrt(fan_in)
    assert float(w.square().mean().sqrt()) == pytest.approx(w.shape[1] ** -0.5, rel=0.1)
    assert float(flat["single_blocks.0.norm.query_norm.scale"].astype(mx.float32).min()) == 1.0


def test_flops_dataclass_total():
    f = flops.Flops(linear=1.0, attention=2.0, other=3.0)
    assert f.total == 6.0
    assert (
        flops.flops_of_vae_decoder(
            SimpleNamespace(block_out_channels=(32, 32), layers_per_block=1, latent_channels=4), 16, 16
        ).total
        > 0
    )


@pytest.mark.parametrize("kind", ["distilled", "base"])
def test_cli_on_the_tiny_snapshot(family, kind, request, tmp_path):
    """`benchmark --model <folder>` reads each family's tiny snapshot in its Hugging Face layout through the
    package's loaders: the family's title, text window (FLUX.2: 512 positions, FLUX 3: 80) and tapped depth
    (27, 32), its FLOPs; Base runs cond and uncond passes, and FLUX 3 Base reports its once-per-image text
    and reference modes on their own row (FLUX.2 has none)."""
    from flux_klein_mlx.family import FAMILIES

    distilled = kind == "distilled"
    snapshot = request.getfixturevalue(f"family_{kind}")
    out = tmp_path / "r.json"
    args = ["--model", str(snapshot), "-W", "80", "-H", "64", "--steps", "2", "--warmup", "0", "--trials", "1"]
    assert bm.main(args + ["--references", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    c, f, st = r["config"], r["flops"], r["stages"]
    assert c["weights"] == "checkpoint" and c["model"] == str(snapshot)
    assert c["variant"] == family.custom_variant
    assert c["title"] == family.title + ("" if distilled else " Base")
    window = family.windows[1]  # the benchmark's prompt is a short one
    assert c["text_tokens_per_pass"] == ([window] if distilled else [window, window]) and c["reference_tokens"] == 20
    params = FAMILIES[family.name].params(json.loads((snapshot / "transformer" / "config.json").read_text()))
    step, once = flops.denoise_flops(
        family.name, params, image_tokens=20, text_tokens=c["text_tokens_per_pass"], reference_tokens=20
    )
    assert f["step_tflop"] == pytest.approx(step.total / 1e12) and f["once_per_image_tflop"] == pytest.approx(
        once.total / 1e12
    )
    hoists = family.base_runs_once_per_image and not distilled
    assert (once.total > 0) == hoists and ("once_per_image" in st) == hoists
    te = json.loads((snapshot / "text_encoder" / "config.json").read_text())
    expected = flops.flops_of_text_encoder(Qwen3Config.from_dict(te), layers=family.text_layers, tokens=window).total
    assert f["text_encoder_tflop"] == pytest.approx(expected / 1e12) and expected > 0
    assert {"text_encoding", "denoise_step", "vae_decode"} <= set(st)


def test_variant_beside_a_model_is_refused_before_any_model(cli, snapshot, tmp_path, no_models):
    """`benchmark --variant` with `--model` would be ignored: one line, before any model, nothing written."""
    from command_line import assert_one_line_error

    code, _, err = cli("benchmark", "--model", snapshot, "--variant", "klein-9b")
    assert_one_line_error(code, err, "--variant only applies to --random-weights")
    assert no_models == [] and list(tmp_path.iterdir()) == []


def test_every_benchmark_binds_openblas_before_mlx_loads():
    """MLX's Linux CPU wheel bundles a reference BLAS ~10-40x slower than OpenBLAS, and OpenBLAS binds only if it
    loads before `mlx.core` (flux_klein_mlx.preload_openblas). benchmarks/common.py loads it, so each script must
    import `common` before any module-level mlx import: sorted imports put `import mlx` first (ruff did, and a
    FLUX 3 training step timed 18x slow), which `# isort: split` after `import common` prevents."""
    import ast

    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.name == "common.py":
            continue
        first = {}
        for node in ast.parse(path.read_text()).body:  # module-level statements only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                root = name.split(".")[0]
                first.setdefault(root, node.lineno)
        if "mlx" in first:
            assert first.get("common", 10**9) < first["mlx"], f"{path.name}: import common before mlx"
