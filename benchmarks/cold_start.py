"""Cold starts: what loading reads, how fast the disk gives it, what read-ahead and the prompt cache save.

    python benchmarks/cold_start.py make --dir /tmp/klein-cold      # random full-size klein-4B, 4-bit (~4.7 GB)
    python benchmarks/cold_start.py run --model /tmp/klein-cold [--json cold.json]
    python benchmarks/cold_start.py make --dir /tmp/klein-bf16 --bits 0 --blocks 1+4   # bf16, 1/5 of the blocks
    python benchmarks/cold_start.py second --model /tmp/klein-bf16 -W 256 -H 256 --steps 1 --dtype float32
    python benchmarks/cold_start.py widen --model /tmp/klein-bf16 --dir /tmp/klein-f32   # its files in float32

`make` writes a converted folder (what `convert --quantize 4` writes) with random weights of
klein-4B's true shapes: 4-bit transformer and Qwen3-4B (layers 1-27), bf16 VAE, the real tokenizer.

`run` measures, each load in a fresh process, the page cache dropped before every cold one
(`bench.measure.drop_from_page_cache`: posix_fadvise, no root; on a Mac it says it cannot, and a cold
start needs `sudo purge`):

1. the disk's sequential read rate on the very bytes the loads read (`sequential_read_rate`);
2. each component loaded cold and warm (`load_component`): seconds, bytes fetched from storage
   (`/proc/self/io` read_bytes, or "n/a") next to the bytes the headers say the load reads,
   peak MLX memory over the load and the process's peak RSS;
3. the transformer loaded cold after a read-ahead that ran (a) alone to the end, and (b) during a
   stand-in compute (float32 matmuls for as long as the read needs, i.e. what the text encoder
   does on a Mac meanwhile): load time, and peak memory next to the plain cold load's;
4. the prompt cache's costs at real size: the key on the real files (first: their headers; then
   remembered), writing and reading a (1, 512, 7680) bf16 entry, and reading the chat template
   the key needs (`chat_template_source`) against building the tokenizer;
5. the floor `bytes / sequential rate` (+ FLOPs / peak where the chip's peak is known).

`second` runs `python -m flux_klein_mlx generate` twice in fresh processes, timed from outside
(process start, imports and the PNG included): the first run with an empty prompt cache, the
second with the same prompt and another seed; once with the page cache dropped first, once warm.

What it cannot do on a Linux CPU: time a whole image at 4 bits. MLX's CPU backend runs quantized
matmuls without BLAS (~0.15 GFLOPS measured here), so the 2.85 TFLOP encoder alone would take
hours. Whole images are timed here on bf16 files computed in float32 (`make --bits 0`, `--dtype
float32`), with fewer transformer blocks where memory requires (`--blocks`); `python -m
flux_klein_mlx benchmark --cold` times every stage of first images, cold and warm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads the script by path
import common  # noqa: E402
import mlx.core as mx  # noqa: E402

COMPONENTS = ("text_encoder", "transformer", "vae")


# --- make -------------------------------------------------------------------------------------------


def make(folder: Path, bits: int = 4, blocks: str | None = None) -> None:
    """A converted klein-4B folder with random weights: transformer and text encoder quantized to
    `bits` (0: bf16), the transformer with `blocks` ("D+S") double + single blocks (default all)."""
    from mlx.utils import tree_flatten

    from flux_klein_mlx.bench.command import parse_blocks
    from flux_klein_mlx.bench.random_model import randomize
    from flux_klein_mlx.convert import Part, write_folder
    from flux_klein_mlx.family import FLUX2
    from flux_klein_mlx.models.flux2.config import VARIANTS
    from flux_klein_mlx.models.quantize import evaluate_by_layer, quantize_model
    from flux_klein_mlx.run.components import build_module

    variant, parts = VARIANTS["klein-4b"], []
    if blocks:
        variant = dataclasses.replace(
            variant, transformer=dataclasses.replace(variant.transformer, **parse_blocks(blocks))
        )
    for seed, name in enumerate(COMPONENTS):
        t0 = time.perf_counter()
        config = dataclasses.asdict(getattr(variant, name))
        module = build_module(name, config, FLUX2)
        randomize(module, mx.bfloat16, seed)
        record = None if name == "vae" or not bits else quantize_model(module, bits)
        evaluate_by_layer(module)  # one component quantized at a time: the bf16 weights go before the next
        parts.append(Part(name, config, dict(tree_flatten(module.parameters())), record))
        print(f"  random {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    meta = {
        "family": "flux2",
        "variant": variant.family,
        "is_distilled": True,
        "dtype": "bfloat16",
        "scheduler": common.SCHEDULER,
        "source": {"model": "random weights (benchmarks/cold_start.py)"},
        "tokenizer_source": common.qwen_tokenizer_dir(),
    }
    write_folder(folder, parts, meta, overwrite=True)
    print(f"wrote {folder}: {common.folder_bytes(folder) / common.GB:.2f} GB")


def widen(source: Path, folder: Path, max_shard: int = 2 * 10**9) -> None:
    """A float32 copy of a converted bf16 folder: files in the dtype a CPU run computes in, so a load
    only reads (as a bf16 run on a Mac does) instead of casting 2 bytes into 4 per weight."""
    from safetensors import safe_open
    from safetensors.torch import save_file  # torch: numpy has no bfloat16

    folder.mkdir(parents=True)
    shutil.copytree(source / "tokenizer", folder / "tokenizer")
    meta = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(meta, dtype="float32"), indent=2) + "\n")
    for name in COMPONENTS:
        files = sorted(source.glob(f"{name}*.safetensors"))
        shards, size, total = [{}], 0, 0
        for f in files:
            with safe_open(f, "pt") as h:
                for key in h.keys():
                    t = h.get_tensor(key)
                    t = t.float() if t.is_floating_point() else t
                    if size > max_shard:  # one shard in memory at a time
                        save_file(shards[-1], folder / f"{name}.part{len(shards)}")
                        shards[-1], size = {k: None for k in shards[-1]}, 0
                        shards.append({})
                    shards[-1][key], size, total = t, size + t.nbytes, total + t.nbytes
        save_file(shards[-1], folder / f"{name}.part{len(shards)}")
        if len(shards) == 1:
            (folder / f"{name}.part1").rename(folder / f"{name}.safetensors")
            continue
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"{name}-{i:05d}-of-{len(shards):05d}.safetensors"
            (folder / f"{name}.part{i}").rename(folder / file)
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{name}.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"wrote {folder}: {common.folder_bytes(folder) / common.GB:.2f} GB")


# --- children: one measurement each, in a fresh process ---------------------------------------------


def busy(seconds: float) -> float:
    """A stand-in for the text encoder's compute: float32 matmuls for `seconds` (mx.eval releases
    the GIL, as during a real encode, so the read-ahead thread runs meanwhile)."""
    a = mx.random.normal((768, 768))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = mx.tanh(a @ a)
        mx.eval(a)
    return time.perf_counter() - t0


def child_load(model: str, name: str, readahead: str | None = None, overlap: float = 0.0) -> dict:
    """Load one component; `readahead` "alone" (read it all first) or "overlap" (read during `overlap`
    seconds of stand-in compute, then stop it and load)."""
    from flux_klein_mlx.bench.measure import StageMeter, bytes_to_load
    from flux_klein_mlx.run.components import load_component
    from flux_klein_mlx.run.loading import describe
    from flux_klein_mlx.storage.readahead import ReadAhead

    info = describe(model)
    meter, out = StageMeter(), {"component": name, "readahead": readahead}
    if readahead:
        ahead = ReadAhead.of_component(info, name).start()
        out["busy_seconds"] = busy(overlap) if readahead == "overlap" else 0.0
        stats = ahead.wait() if readahead == "alone" else ahead.stop()
        out["readahead"] = {"mode": readahead, "bytes": stats.bytes, "seconds": stats.seconds, "stopped": stats.stopped}
        out["before_load"] = meter.mark("before_load")
    mx.reset_peak_memory()
    load_component(info, name)
    out["load"] = meter.mark("load")
    out.update(
        bytes_to_load=bytes_to_load(info, name),
        peak_memory=mx.get_peak_memory(),
        max_rss=common.max_rss_bytes(),
        io_source=meter.source,
    )
    return out


def child_cache(model: str) -> dict:
    """The prompt cache's costs on the real files and a real-size entry."""
    from flux_klein_mlx.models.tokenizer import chat_template_source, load_tokenizer
    from flux_klein_mlx.run.loading import describe
    from flux_klein_mlx.storage.embedding_cache import EmbeddingCache

    info, out = describe(model), {}
    t0 = time.perf_counter()
    template = chat_template_source(info.tokenizer)  # what a hit needs ...
    out["template_read_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert load_tokenizer(info.tokenizer).hf_tokenizer.chat_template == template  # ... instead of the tokenizer
    out["tokenizer_load_seconds"] = time.perf_counter() - t0
    files = info.files["text_encoder"]
    emb = mx.random.normal((1, 512, 3 * 2560), key=mx.random.key(0)).astype(mx.bfloat16)  # klein-4B
    mx.eval(emb)
    with tempfile.TemporaryDirectory() as folder:
        for run in ("key_first", "key_remembered"):
            t0 = time.perf_counter()
            key = EmbeddingCache(folder).key(
                files, template=template, max_length=512, prompt="a red fox", settings={"dtype": "bfloat16"}
            )
            out[run + "_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        EmbeddingCache(folder).put(key, emb)
        out["put_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        hit = EmbeddingCache(folder).get(key)
        mx.eval(hit)
        out["get_seconds"] = time.perf_counter() - t0
        out["entry_bytes"] = EmbeddingCache(folder).total_bytes()
        out["hit_equals"] = bool(mx.array_equal(hit, emb).item())
    return out


def run_child(task: str, **kwargs) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps({"task": task, **kwargs})]
    result = common.run_json_child(cmd, f"{task} {kwargs}")
    print(f"  {task} {kwargs}: {json.dumps(result)[:300]}", flush=True)
    return result


# --- run ------------------------------------------------------------------------------------------------


def measure(model: str) -> dict:
    """Every measurement of the module docstring; returns them (and prints progress)."""
    from flux_klein_mlx.bench.flops import (
        flops_of_text_encoder,
        flops_of_transformer,
        flops_of_vae_decoder,
        machine_info,
    )
    from flux_klein_mlx.bench.measure import bytes_to_load, drop_from_page_cache, sequential_read_rate
    from flux_klein_mlx.run.loading import describe
    from flux_klein_mlx.storage.readahead import component_spans

    info = describe(model)
    files = {n: list(info.files[n]) for n in COMPONENTS}
    every = [f for n in COMPONENTS for f in files[n]]
    results = {"machine": machine_info(), "model": str(model), "drop": drop_from_page_cache(every)}
    spans = [s for n in COMPONENTS for s in component_spans(info, n)]
    rate = sequential_read_rate(spans)
    results["sequential"] = {"bytes": rate.bytes, "seconds": rate.seconds, "rate": rate.rate}
    results["loads"] = []
    for name in COMPONENTS:
        for cold in (True, False):
            if cold:
                drop_from_page_cache(files[name])
            results["loads"].append(dict(run_child("load", model=model, name=name), cold=cold))
    t_read = bytes_to_load(info, "transformer") / rate.rate
    for mode in ("alone", "overlap"):
        drop_from_page_cache(files["transformer"])
        r = run_child("load", model=model, name="transformer", readahead=mode, overlap=1.2 * t_read)
        results["loads"].append(dict(r, cold=True))
    results["cache"] = run_child("cache", model=model)
    total = sum(bytes_to_load(info, n) for n in COMPONENTS)
    flops = (
        flops_of_text_encoder(_qwen(info)).total
        + flops_of_transformer(info.params, width=1024, height=1024).total * 4
        + flops_of_vae_decoder(_vae(info), 1024, 1024).total
    )
    peak = results["machine"].get("peak_tflops")
    results["limit"] = {
        "bytes": total,
        "read_seconds": total / rate.rate,
        "flops_1024_4_steps": flops,
        "compute_seconds_at_peak": flops / (peak * 1e12) if peak else None,
    }
    return results


def _qwen(info):
    from flux_klein_mlx.models.config import Qwen3Config

    return Qwen3Config.from_dict(info.configs["text_encoder"])


def _vae(info):
    from flux_klein_mlx.models.config import AutoEncoderConfig

    return AutoEncoderConfig.from_dict(info.configs["vae"])


def report(r: dict) -> str:
    gb = common.GB
    seq = r["sequential"]
    lines = [
        f"model {r['model']}; page cache: {r['drop']}",
        f"sequential read: {seq['bytes'] / gb:.2f} GB in {seq['seconds']:.2f} s = {seq['rate'] / gb:.2f} GB/s",
        "",
        "| component | start | read-ahead | load s | read from storage GB | load reads GB | peak MLX GB | max RSS GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in r["loads"]:
        ra = x["readahead"]
        how = (
            "-"
            if not ra
            else f"{ra['mode']}: {ra['bytes'] / gb:.2f} GB in {ra['seconds']:.2f} s"
            + (f" during {x['busy_seconds']:.2f} s compute" if ra["mode"] == "overlap" else "")
        )
        read = x["load"]["read_bytes"]
        lines.append(
            f"| {x['component']} | {'cold' if x['cold'] else 'warm'} | {how} | {x['load']['seconds']:.2f} | "
            f"{'n/a' if read is None else f'{read / gb:.2f}'} | {x['bytes_to_load'] / gb:.2f} | "
            f"{x['peak_memory'] / gb:.2f} | {x['max_rss'] / gb:.2f} |"
        )
    c, lim = r["cache"], r["limit"]
    lines += [
        "",
        f"prompt cache: chat template read {c['template_read_seconds'] * 1e3:.1f} ms (tokenizer load "
        f"{c['tokenizer_load_seconds']:.3f} s); key {c['key_first_seconds'] * 1e3:.1f} ms "
        f"(headers read), {c['key_remembered_seconds'] * 1e3:.1f} ms (remembered); "
        f"put {c['put_seconds'] * 1e3:.1f} ms, "
        f"get {c['get_seconds'] * 1e3:.1f} ms for a {c['entry_bytes'] / 1e6:.1f} MB entry; "
        f"hit bit-identical: {c['hit_equals']}",
        f"floor: {lim['bytes'] / gb:.2f} GB / {seq['rate'] / gb:.2f} GB/s = {lim['read_seconds']:.2f} s of reading"
        + (
            f" + {lim['compute_seconds_at_peak']:.2f} s of compute at peak (1024², 4 steps)"
            if lim["compute_seconds_at_peak"]
            else f"; compute {lim['flops_1024_4_steps'] / 1e12:.1f} TFLOP at 1024², 4 steps "
            "(no peak known for this device)"
        ),
    ]
    return "\n".join(lines)


# --- second: `generate` twice, as a user runs it ------------------------------------------------------


def second_generate(model: str, width: int, height: int, steps: int, dtype: str) -> dict:
    """`python -m flux_klein_mlx generate` in fresh processes, timed from outside (process start,
    imports and PNG writing included): a first run with an empty prompt cache, then the same prompt
    with another seed; once after dropping the page cache (first run cold) and once warm."""
    import os
    import shutil
    import subprocess

    from flux_klein_mlx.bench.measure import drop_from_page_cache
    from flux_klein_mlx.run.loading import describe

    info = describe(model)
    files = [f for n in COMPONENTS for f in info.files[n]]
    out = {"model": model, "settings": {"width": width, "height": height, "steps": steps, "dtype": dtype}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="flux-klein-second-") as tmp:
        env = dict(os.environ, FLUX_KLEIN_CACHE=str(Path(tmp) / "cache"))
        for start in ("cold", "warm"):
            shutil.rmtree(Path(tmp) / "cache", ignore_errors=True)  # the first run encodes its prompt
            if start == "cold":
                out["page_cache"] = drop_from_page_cache(files)
            for run, seed in (("first", 1), ("second", 2)):
                cmd = [
                    sys.executable,
                    "-m",
                    "flux_klein_mlx",
                    "generate",
                    "-m",
                    str(model),
                    "-p",
                    "a red fox in fresh snow",
                    "-W",
                    str(width),
                    "-H",
                    str(height),
                    "--steps",
                    str(steps),
                    "--dtype",
                    dtype,
                    "--seed",
                    str(seed),
                    "-o",
                    str(Path(tmp) / f"{start}-{run}.png"),
                ]
                t0 = time.perf_counter()
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if r.returncode:
                    raise SystemExit(f"generate failed: {r.stderr.strip()[-2000:]}")
                lines = r.stderr.strip().splitlines()
                out["runs"][f"{start} {run}"] = {
                    "seconds": wall,
                    "cached": "prompt embeddings cached" in r.stderr,
                    "summary": [ln for ln in lines if ln.startswith("seed ")][-1:],
                }
                print(f"  {start} {run}: {wall:.1f} s; {out['runs'][f'{start} {run}']['summary']}", flush=True)
    return out


# --- overlap: cold first images with and without read-ahead, alternated ------------------------------


def overlap(model: str, width: int, height: int, steps: int, dtype: str, pairs: int) -> dict:
    """`pairs` x (cold first image with read-ahead, the same without), alternated in one process
    (`time_to_image.one_run`, prompt not cached): what reading the transformer during the encode,
    and the VAE during the last step, saves or costs."""
    import statistics

    from flux_klein_mlx.bench.measure import drop_from_page_cache
    from flux_klein_mlx.bench.time_to_image import one_run
    from flux_klein_mlx.inputs.settings import RunSettings
    from flux_klein_mlx.run.loading import describe

    info = describe(model)
    files = [f for n in COMPONENTS for f in info.files[n]]
    settings = RunSettings("a red fox in fresh snow", width=width, height=height, steps=steps, seed=1)
    runs = {"read-ahead": [], "none": []}
    for i in range(pairs):
        for mode in ("read-ahead", "none") if i % 2 == 0 else ("none", "read-ahead"):
            drop_from_page_cache(files)
            run = one_run(model, settings, cache=False, read_ahead=mode == "read-ahead", dtype=dtype)
            st = run.stages
            print(
                f"  {mode}: {run.seconds:.2f} s (encode {st['encode'].seconds:.2f}, transformer load "
                f"{st['transformer load'].seconds:.2f}, peak RSS {run.peak_rss / 1e9:.2f} GB)",
                flush=True,
            )
            runs[mode].append(dataclasses.asdict(run))
    med = lambda xs: statistics.median(xs)  # noqa: E731
    summary = {
        mode: {
            "seconds": med([r["seconds"] for r in rs]),
            **{k: med([r["stages"][k]["seconds"] for r in rs]) for k in ("encode", "transformer load", "VAE load")},
            "peak_memory": max(r["peak_memory"] for r in rs),
            "peak_rss": max(r["peak_rss"] for r in rs),
        }
        for mode, rs in runs.items()
    }
    return {"model": model, "pairs": pairs, "runs": runs, "median": summary}


def report_second(r: dict) -> str:
    runs = r["runs"]
    lines = [
        f"model {r['model']}, {r['settings']}; page cache before the cold pair: {r.get('page_cache')}",
        "",
        "| run | wall s | prompt from the cache | generate's summary |",
        "|---|---|---|---|",
    ]
    for name, x in runs.items():
        lines.append(f"| {name} | {x['seconds']:.1f} | {x['cached']} | {' '.join(x['summary'])} |")
    for start in ("cold", "warm"):
        lines.append(
            f"{start}: second / first = {runs[f'{start} second']['seconds'] / runs[f'{start} first']['seconds']:.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["make", "widen", "run", "second", "overlap"], nargs="?", default="run")
    p.add_argument("--pairs", type=int, default=3, help="overlap: cold runs with and without read-ahead, each")
    p.add_argument("--dir", type=Path, default=Path("/tmp/klein-cold"), help="make, widen: the folder to write")
    p.add_argument("--bits", type=int, choices=[0, 4, 8], default=4, help="make: quantization (0: bf16)")
    p.add_argument("--blocks", default=None, help="make: transformer blocks DOUBLE+SINGLE (default 5+20)")
    p.add_argument("--model", default="/tmp/klein-cold", help="run, widen: a converted (or any) klein model")
    p.add_argument("--json", type=Path, default=None, help="run, second: also write the results here")
    p.add_argument("-W", "--width", type=int, default=256, help="second: image width")
    p.add_argument("-H", "--height", type=int, default=256, help="second: image height")
    p.add_argument("--steps", type=int, default=1, help="second: denoising steps")
    p.add_argument("--dtype", default="float32", help="second: compute dtype (float32: BLAS on a CPU)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        task = spec.pop("task")
        print(json.dumps({"load": child_load, "cache": child_cache}[task](**spec)))
        return
    if args.what == "make":
        make(args.dir, args.bits, args.blocks)
        return
    if args.what == "widen":
        widen(Path(args.model), args.dir)
        return
    if args.what == "overlap":
        results = overlap(args.model, args.width, args.height, args.steps, args.dtype, args.pairs)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        for mode, m in results["median"].items():
            print(
                f"{mode}: median {m['seconds']:.2f} s; encode {m['encode']:.2f} s, transformer load "
                f"{m['transformer load']:.2f} s, VAE load {m['VAE load']:.2f} s; "
                f"peak MLX {m['peak_memory'] / 1e9:.2f} GB, "
                f"peak RSS {m['peak_rss'] / 1e9:.2f} GB"
            )
        return
    if args.what == "second":
        results = second_generate(args.model, args.width, args.height, args.steps, args.dtype)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(report_second(results))
        return
    results = measure(args.model)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(report(results))


if __name__ == "__main__":
    main()
