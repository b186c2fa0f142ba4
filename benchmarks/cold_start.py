"""Cold starts: what loading reads, how fast the disk gives it, what read-ahead and the prompt cache save.

    python benchmarks/cold_start.py make --dir /tmp/klein-cold      # random full-size klein-4B, 4-bit (~4.7 GB)
    python benchmarks/cold_start.py run --model /tmp/klein-cold [--json cold.json]

`make` writes a converted folder (what `convert --quantize 4` writes) with random weights of
klein-4B's true shapes: 4-bit transformer and Qwen3-4B (layers 1-27), bf16 VAE, the real tokenizer.

`run` measures, each load in a fresh process, the page cache dropped before every cold one
(`readahead.drop_from_page_cache`: posix_fadvise, no root; on a Mac it says it cannot, and a cold
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

What it cannot do on a Linux CPU: time a whole image at 4 bits. MLX's CPU backend runs quantized
matmuls without BLAS (~0.15 GFLOPS measured here), so the 2.85 TFLOP encoder alone would take
hours; `benchmark --cold` times first images on a Mac.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads the script by path
import common  # noqa: E402

import mlx.core as mx  # noqa: E402

COMPONENTS = ("text_encoder", "transformer", "vae")


# --- make -------------------------------------------------------------------------------------------


def make(folder: Path) -> None:
    """A converted klein-4B folder with random weights, 4-bit transformer and text encoder."""
    from mlx.utils import tree_flatten

    from flux_klein_mlx.config import VARIANTS
    from flux_klein_mlx.convert import Part, write_folder
    from flux_klein_mlx.loading import build_module
    from flux_klein_mlx.quantize import evaluate_by_layer, quantize_model
    from flux_klein_mlx.random_model import randomize

    variant, parts = VARIANTS["klein-4b"], []
    for seed, name in enumerate(COMPONENTS):
        t0 = time.perf_counter()
        config = dataclasses.asdict(getattr(variant, name))
        module = build_module(name, config)
        randomize(module, mx.bfloat16, seed)
        record = None if name == "vae" else quantize_model(module, 4)
        evaluate_by_layer(module)  # one component quantized at a time: the bf16 weights go before the next
        parts.append(Part(name, config, dict(tree_flatten(module.parameters())), record))
        print(f"  random {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    meta = {"variant": variant.family, "is_distilled": True, "dtype": "bfloat16", "scheduler": common.SCHEDULER,
            "source": {"model": "random weights (benchmarks/cold_start.py)"}, "tokenizer_source": common.qwen_tokenizer_dir()}  # fmt: skip
    write_folder(folder, parts, meta, overwrite=True)
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
    from flux_klein_mlx.loading import describe, load_component
    from flux_klein_mlx.readahead import ReadAhead, StageMeter, bytes_to_load

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
    out.update(bytes_to_load=bytes_to_load(info, name), peak_memory=mx.get_peak_memory(), max_rss=common.max_rss_bytes(),
               io_source=meter.source)  # fmt: skip
    return out


def child_cache(model: str) -> dict:
    """The prompt cache's costs on the real files and a real-size entry."""
    from flux_klein_mlx.embedding_cache import EmbeddingCache
    from flux_klein_mlx.loading import describe
    from flux_klein_mlx.tokenizer import chat_template_source, load_tokenizer

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
            key = EmbeddingCache(folder).key(files, template=template, max_length=512, prompt="a red fox", settings={"dtype": "bfloat16"})
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
    from flux_klein_mlx.flops import flops_of_text_encoder, flops_of_transformer, flops_of_vae_decoder, machine_info
    from flux_klein_mlx.loading import describe
    from flux_klein_mlx.readahead import bytes_to_load, component_spans, drop_from_page_cache, sequential_read_rate

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
    flops = (flops_of_text_encoder(_qwen(info)).total
             + flops_of_transformer(info.params, 1024, 1024).total * 4
             + flops_of_vae_decoder(_vae(info), 1024, 1024).total)  # fmt: skip
    peak = results["machine"].get("peak_tflops")
    results["limit"] = {"bytes": total, "read_seconds": total / rate.rate, "flops_1024_4_steps": flops,
                        "compute_seconds_at_peak": flops / (peak * 1e12) if peak else None}  # fmt: skip
    return results


def _qwen(info):
    from flux_klein_mlx.config import Qwen3Config

    return Qwen3Config.from_dict(info.configs["text_encoder"])


def _vae(info):
    from flux_klein_mlx.config import AutoEncoderConfig

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
        how = "-" if not ra else f"{ra['mode']}: {ra['bytes'] / gb:.2f} GB in {ra['seconds']:.2f} s" + (
            f" during {x['busy_seconds']:.2f} s compute" if ra["mode"] == "overlap" else "")
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
        f"(headers read), {c['key_remembered_seconds'] * 1e3:.1f} ms (remembered); put {c['put_seconds'] * 1e3:.1f} ms, "
        f"get {c['get_seconds'] * 1e3:.1f} ms for a {c['entry_bytes'] / 1e6:.1f} MB entry; hit bit-identical: {c['hit_equals']}",
        f"floor: {lim['bytes'] / gb:.2f} GB / {seq['rate'] / gb:.2f} GB/s = {lim['read_seconds']:.2f} s of reading"
        + (f" + {lim['compute_seconds_at_peak']:.2f} s of compute at peak (1024², 4 steps)" if lim["compute_seconds_at_peak"] else
           f"; compute {lim['flops_1024_4_steps'] / 1e12:.1f} TFLOP at 1024², 4 steps (no peak known for this device)"),
    ]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["make", "run"], nargs="?", default="run")
    p.add_argument("--dir", type=Path, default=Path("/tmp/klein-cold"), help="make: the folder to write")
    p.add_argument("--model", default="/tmp/klein-cold", help="run: a converted (or any) klein model")
    p.add_argument("--json", type=Path, default=None, help="run: also write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        task = spec.pop("task")
        print(json.dumps({"load": child_load, "cache": child_cache}[task](**spec)))
        return
    if args.what == "make":
        make(args.dir)
        return
    results = measure(args.model)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(report(results))


if __name__ == "__main__":
    main()
