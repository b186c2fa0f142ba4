"""Time to the first image, cold and warm, against its physical limit (`benchmark --cold`).

`measure_cold(model, ...)` measures, in one call on a model folder (real or random weights):

- the bytes each component's load reads (`measure.bytes_to_load`, from the headers);
- the disk's sequential read rate on those very byte ranges, read cold (`sequential_read_rate`);
- one image in each of these runs, each through a fresh `load()` as a new `generate` would:

  | run | page cache | prompt embeddings | what it stands for |
  |---|---|---|---|
  | cold | dropped | not cached | the first run after a reboot |
  | cold, no read-ahead | dropped | not cached | the same without `readahead.Prefetch` |
  | warm | files cached | not cached (cache off) | a run with another prompt |
  | second | files cached | cached, another seed | a second `generate` with the same prompt |
  | cold, cached | dropped | cached | the same prompt after a reboot |

  each split into its stages (load() + checks, text encoder load, encode, transformer load,
  denoise, VAE load, decode) with seconds and, on Linux, the bytes fetched from storage
  (`/proc/self/io`), and its peak MLX memory;
- the limit of a cold run, `bytes / rate + compute`, with compute taken two ways: the warm runs'
  own compute (their stages less their loads) and `FLOPs / peak` (the chip's published peak, or
  where none is known, as on a CPU, the rate of one large matmul measured here in the run's dtype).

Process start and imports are outside a run here; `import_seconds` measures them in a child process.

Cold starts: `measure.drop_from_page_cache`. Where it cannot evict (macOS), the result says so, and
a cold start is approximated by running `sudo purge` right before the benchmark (the first run is
then cold; the later "cold" runs are labelled as not dropped).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import resource
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..models.config import AutoEncoderConfig, Qwen3Config
from ..embedding_cache import EmbeddingCache
from .flops import flops_of_text_encoder, flops_of_transformer, flops_of_vae_decoder, machine_info
from ..inputs import RunSettings, prepare_inputs
from ..loading import as_dtype, describe
from ..pipeline import load
from ..readahead import component_spans
from .measure import StageMeter, bytes_to_load, drop_from_page_cache, sequential_read_rate
from ..models.tokenizer import load_tokenizer

PROMPT = "a red fox in fresh snow at dawn, soft light, 35 mm photograph"
COMPONENTS = ("text_encoder", "transformer", "vae")
RUNS = (  # name, drop the page cache, use the run's prompt cache (else none), read ahead, seed
    ("cold", True, True, True, 1),
    ("cold, no read-ahead", True, False, False, 1),
    ("warm", False, False, True, 1),
    ("second", False, True, True, 2),
    ("cold, cached", True, True, True, 3),
)


def one_run(model, settings: RunSettings, *, cache, read_ahead: bool = True, **load_args) -> dict:
    """One image through a fresh pipeline, each stage timed on its own, in the order `generate` runs
    them (the loads `prepare`/`denoise`/`decode` would make are made just before, and timed)."""
    rss_reset = reset_peak_rss()
    meter, peaks, t0 = StageMeter(), {}, time.perf_counter()

    def stage(name: str, work: Callable[[], object]):
        mx.reset_peak_memory()
        out = work()
        peaks[name] = mx.get_peak_memory()
        meter.mark(name)
        return out

    def start():  # what generate does before any model loads
        pipe = load(model, cache=cache, **load_args)
        pipe.prefetch.enabled = read_ahead
        prepared = prepare_inputs(settings, pipe.info)
        return pipe, prepared, pipe.check_text_encoder(prepared)

    pipe, prepared, encodes = stage("load() + checks", start)
    if encodes:  # the prompt is not cached: the encoder loads first
        stage("text encoder load", lambda: pipe.component("text_encoder"))
        stage("tokenizer load", lambda: pipe.component("tokenizer"))
    job = stage("encode", lambda: pipe.prepare(prepared))
    stage("transformer load", lambda: pipe.component("transformer"))
    stage("denoise", lambda: [None for _ in pipe.denoise(job)])
    stage("VAE load", lambda: pipe.component("vae"))
    stage("decode", lambda: pipe.decode(job))
    total = time.perf_counter() - t0
    ahead = {k: {"bytes": v.bytes, "seconds": v.seconds} for k, v in pipe.prefetch.finished.items()}
    pipe = prepared = job = None  # the models go before the next run loads its own
    gc.collect()
    mx.clear_cache()
    stages = {k: dict(v, peak_memory=peaks[k]) for k, v in meter.stages.items()}
    return {"seconds": total, "stages": stages, "read_ahead": ahead, "io_source": meter.source,
            "peak_memory": max(peaks.values()), "peak_rss": peak_rss(), "peak_rss_of_run": rss_reset}  # fmt: skip


def reset_peak_rss() -> bool:
    """Linux: restart the process's peak-RSS count (VmHWM) so that each run reports its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak resident memory of this process in bytes: since the last `reset_peak_rss` on Linux,
    since it started elsewhere."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def matmul_rate(dtype, n: int = 2048, trials: int = 3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (best of `trials`): the stand-in for a peak where no
    published one applies (a CPU)."""
    a = mx.random.normal((n, n)).astype(dtype)
    mx.eval(a @ a)  # warm-up
    return 2 * n**3 / min(timeit.repeat(lambda: mx.eval(a @ a), number=1, repeat=trials))


def import_seconds() -> dict:
    """Wall time of a fresh Python importing what `generate` imports, and what a run of the text
    encoder adds (mlx_lm, which imports transformers and torch)."""
    out = {}
    for name, code in (("generate", "import flux_klein_mlx.generate"),
                       ("+ the text encoder's", "import flux_klein_mlx.generate, mlx_lm.models.qwen3, transformers")):  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        out[name] = time.perf_counter() - t0
    return out


def measure_cold(model, *, width: int = 256, height: int = 256, steps: int = 1, dtype: str = "bfloat16",
                 quantize: int | None = None, vae=None, log: Callable[[str], None] = lambda msg: None) -> dict:  # fmt: skip
    """Every measurement of the module docstring, as a JSON-able dict (`format_cold` prints it)."""
    settings = RunSettings(PROMPT, width=width, height=height, steps=steps).check()  # before any work
    info = describe(model, vae=vae)
    files = sorted({f for n in COMPONENTS for f in info.files[n]} | set(info.decoder_files or []))
    files += sorted(p for p in Path(info.tokenizer).glob("*") if p.is_file())
    machine = machine_info()
    result = {"model": str(model), "machine": machine, "imports": import_seconds(),
              "settings": {"width": width, "height": height, "steps": steps, "dtype": dtype, "quantize": quantize,
                           "vae": None if vae is None else str(vae)},
              "bytes": {n: bytes_to_load(info, n) for n in COMPONENTS}}  # fmt: skip
    result["page_cache"] = drop_from_page_cache(files)
    dropped = result["page_cache"].startswith("dropped")
    rate = sequential_read_rate([s for n in COMPONENTS for s in component_spans(info, n)])
    result["read"] = {"bytes": rate.bytes, "seconds": rate.seconds, "rate": rate.rate, "cold": dropped}
    log(f"sequential read: {rate.bytes / 1e9:.2f} GB at {rate.rate / 1e9:.2f} GB/s ({result['page_cache']})")
    # Imports happen once per process, not once per run here (`import_seconds` has their cost): made
    # now, so that no run below pays them and the runs compare what a run does.
    importlib.import_module("mlx_lm.models.qwen3")
    load_tokenizer(info.tokenizer)
    load_args = {"dtype": dtype, "quantize": quantize, "vae": vae}
    result["runs"] = {}
    with tempfile.TemporaryDirectory(prefix="flux-klein-cold-") as folder:
        shared = EmbeddingCache(folder)
        for name, cold, cache, read_ahead, seed in RUNS:
            if cold:
                drop_from_page_cache(files)
            run = one_run(model, dataclasses.replace(settings, seed=seed), cache=shared if cache else False,
                          read_ahead=read_ahead, **load_args)  # fmt: skip
            run["page_cache"] = "dropped" if cold and dropped else "warm" if not cold else "not dropped"
            result["runs"][name] = run
            log(f"{name}: {run['seconds']:.2f} s")
    peak = machine["peak_tflops"] * 1e12 if machine["peak_tflops"] else None
    result["peak"] = {"flops": peak or matmul_rate(as_dtype(dtype)),
                      "source": "published peak of this chip" if peak else f"measured {dtype} matmul (2048^3) here"}  # fmt: skip
    result["flops"] = {
        "text_encoder": flops_of_text_encoder(Qwen3Config.from_dict(info.configs["text_encoder"])).total,
        "denoise": flops_of_transformer(info.params, width, height).total * steps,
        "decode": flops_of_vae_decoder(AutoEncoderConfig.from_dict(info.configs["vae"]), width, height).total,
    }
    result["limits"] = limits(result)
    return result


LOADS = ("load() + checks", "text encoder load", "tokenizer load", "transformer load", "VAE load")


def limits(r: dict) -> dict:
    """Each cold run against `bytes / rate + compute` (compute: the warm twin's measured compute, and
    FLOPs / peak); `ratio` = measured / limit."""
    rate, peak, b, f = r["read"]["rate"], r["peak"]["flops"], r["bytes"], r["flops"]
    out = {}
    for cold, warm, encodes in (("cold", "warm", True), ("cold, no read-ahead", "warm", True),
                                ("cold, cached", "second", False)):  # fmt: skip
        parts = COMPONENTS if encodes else COMPONENTS[1:]
        read = sum(b[n] for n in parts) / rate
        flops = f["denoise"] + f["decode"] + (f["text_encoder"] if encodes else 0.0)
        measured = r["runs"][cold]["seconds"]
        # the warm run's time less its loads and checks: encode, denoise and decode
        warm_compute = sum(v["seconds"] for k, v in r["runs"][warm]["stages"].items() if k not in LOADS)
        out[cold] = {"bytes": sum(b[n] for n in parts), "read_seconds": read, "warm_compute_seconds": warm_compute,
                     "limit_seconds": read + warm_compute, "ratio": measured / (read + warm_compute),
                     "flops": flops, "physics_seconds": read + flops / peak, "physics_ratio": measured / (read + flops / peak)}  # fmt: skip
    second, first = r["runs"]["second"]["seconds"], r["runs"]["cold"]["seconds"]
    out["second vs first"] = {"vs_cold": second / first, "vs_warm": second / r["runs"]["warm"]["seconds"]}
    return out


def format_cold(r: dict) -> str:
    """The result as tables for people (the JSON has every number)."""
    gb, s, m = 1e9, r["settings"], r["machine"]
    lines = [
        f"time to first image: {r['model']}, {s['width']}x{s['height']}, {s['steps']} step(s), {s['dtype']}"
        + (f", {s['quantize']}-bit" if s["quantize"] else "") + (f", VAE {s['vae']}" if s["vae"] else ""),
        f"{m['cpu']} ({m['cpu_cores']} cores, {m['memory_gb']} GB), MLX {m['mlx']} on {m['device']}; page cache: {r['page_cache']}",
        "bytes each load reads: " + ", ".join(f"{n.replace('_', ' ')} {v / gb:.2f} GB" for n, v in r["bytes"].items()),
        f"sequential read of those bytes{' (cold)' if r['read']['cold'] else ' (NOT cold)'}: {r['read']['bytes'] / gb:.2f} GB in "
        f"{r['read']['seconds']:.2f} s = {r['read']['rate'] / gb:.2f} GB/s",
        "process start + imports (child process): " + ", ".join(f"{k} {v:.2f} s" for k, v in r["imports"].items()),
        "",
    ]  # fmt: skip
    names = list(r["runs"])
    lines += ["| stage | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for st in dict.fromkeys(k for run in r["runs"].values() for k in run["stages"]):
        cells = []
        for n in names:
            v = r["runs"][n]["stages"].get(st)
            read = "" if v is None or v["read_bytes"] is None else f" ({v['read_bytes'] / gb:.2f} GB read)"
            cells.append("-" if v is None else f"{v['seconds']:.2f} s{read}")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(f"**{r['runs'][n]['seconds']:.2f} s**" for n in names) + " |")
    lines.append("| peak MLX memory | " + " | ".join(f"{r['runs'][n]['peak_memory'] / gb:.2f} GB" for n in names) + " |")
    lines.append("| peak RSS" + ("" if r["runs"][names[0]]["peak_rss_of_run"] else " (process, so far)") + " | "
                 + " | ".join(f"{r['runs'][n]['peak_rss'] / gb:.2f} GB" for n in names) + " |")
    lines.append("| read ahead | " + " | ".join(
        ", ".join(f"{k} {v['bytes'] / gb:.2f} GB" for k, v in r["runs"][n]["read_ahead"].items()) or "-" for n in names) + " |")
    lines.append("")
    peak = r["peak"]
    for name, lim in r["limits"].items():
        if name == "second vs first":
            lines.append(f"second run (same prompt, another seed): {lim['vs_cold']:.2f}x the cold first run, "
                         f"{lim['vs_warm']:.2f}x the warm one")  # fmt: skip
            continue
        lines.append(
            f"{name}: {r['runs'][name]['seconds']:.2f} s = {lim['ratio']:.2f}x (bytes / rate + warm compute = "
            f"{lim['read_seconds']:.2f} + {lim['warm_compute_seconds']:.2f} s), {lim['physics_ratio']:.2f}x "
            f"(bytes / rate + FLOPs / peak = {lim['read_seconds']:.2f} + {lim['flops'] / peak['flops']:.2f} s; "
            f"peak {peak['flops'] / 1e9:.0f} GFLOPS, {peak['source']})"
        )
    return "\n".join(lines)
