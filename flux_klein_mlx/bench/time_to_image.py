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
import math
import resource
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..dtypes import DEFAULT_DTYPE, as_dtype
from ..inputs.settings import RunSettings, prepare_inputs
from ..models.config import AutoEncoderConfig, Qwen3Config
from ..models.rope import token_grid
from ..models.tokenizer import load_tokenizer
from ..run.loading import describe
from ..run.pipeline import load
from ..storage.embedding_cache import EmbeddingCache
from ..storage.readahead import component_spans
from .flops import denoise_flops, flops_of_text_encoder, flops_of_vae_decoder, machine_info
from .measure import StageMeter, bytes_to_load, drop_from_page_cache, sequential_read_rate
from .random_model import REAL_PROMPT_TOKENS

PROMPT = "a red fox in fresh snow at dawn, soft light, 35 mm photograph"
LOAD_ORDER = ("text_encoder", "transformer", "vae")  # the order a run loads its models


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """One of the runs of the module docstring's table."""

    name: str
    drop_page_cache: bool
    prompt_cache: bool  # use the benchmark's own prompt cache (else none)
    read_ahead: bool
    seed: int


RUNS = (
    RunPlan(name="cold", drop_page_cache=True, prompt_cache=True, read_ahead=True, seed=1),
    RunPlan(name="cold, no read-ahead", drop_page_cache=True, prompt_cache=False, read_ahead=False, seed=1),
    RunPlan(name="warm", drop_page_cache=False, prompt_cache=False, read_ahead=True, seed=1),
    RunPlan(name="second", drop_page_cache=False, prompt_cache=True, read_ahead=True, seed=2),
    RunPlan(name="cold, cached", drop_page_cache=True, prompt_cache=True, read_ahead=True, seed=3),
)
# A cold run, the warm run whose compute it is held against, and whether it encodes its prompt.
LIMITED = (("cold", "warm", True), ("cold, no read-ahead", "warm", True), ("cold, cached", "second", False))


@dataclass(kw_only=True)
class Stage:
    seconds: float
    read_bytes: int | None  # fetched from storage (Linux `/proc/self/io`), None where not counted
    peak_memory: int  # MLX peak during the stage


@dataclass(kw_only=True)
class BytesRead:
    bytes: int
    seconds: float


@dataclass(kw_only=True)
class ColdRun:
    """One image through a fresh pipeline (`one_run`)."""

    seconds: float
    stages: dict[str, Stage]  # in the order they ran
    read_ahead: dict[str, BytesRead]  # component -> what was read ahead of its load
    io_source: str  # where `Stage.read_bytes` come from
    peak_memory: int
    peak_rss: int
    peak_rss_of_run: bool  # peak_rss counts this run only (Linux), else the process so far
    page_cache: str = ""  # "dropped", "warm" or "not dropped", set by `measure_cold`


@dataclass(kw_only=True)
class Settings:
    width: int
    height: int
    steps: int
    dtype: str
    quantize: int | None
    vae: str | None


@dataclass(kw_only=True)
class SequentialRead:
    bytes: int
    seconds: float
    rate: float  # bytes per second
    cold: bool  # the page cache was dropped first


@dataclass(kw_only=True)
class Peak:
    flops: float  # FLOP/s
    source: str


@dataclass(kw_only=True)
class StageFlops:
    text_encoder: float
    denoise: float
    decode: float


@dataclass(kw_only=True)
class Limit:
    """A cold run against `bytes / rate + compute`, compute two ways; a ratio is measured / limit."""

    bytes: int
    read_seconds: float
    warm_compute_seconds: float
    limit_seconds: float
    ratio: float
    flops: float
    physics_seconds: float
    physics_ratio: float


@dataclass(kw_only=True)
class SecondRun:
    vs_cold: float  # the second run's time over the cold first run's
    vs_warm: float


@dataclass(kw_only=True)
class ColdResult:
    """Every measurement of the module docstring (`to_json()` for `--json`)."""

    model: str
    machine: dict  # flops.machine_info()
    imports: dict[str, float]  # what is imported -> seconds
    settings: Settings
    bytes: dict[str, int]  # component -> bytes its load reads
    page_cache: str  # how the page cache was dropped, or why not
    read: SequentialRead
    runs: dict[str, ColdRun]
    peak: Peak
    flops: StageFlops
    limits: dict[str, Limit]  # cold run -> its limit
    second: SecondRun

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def one_run(model, settings: RunSettings, *, cache, read_ahead: bool = True, **load_args) -> ColdRun:
    """One image through a fresh pipeline, each stage timed on its own, in the order `generate` runs
    them (the loads `prepare`/`denoise`/`decode` would make are made just before, and timed)."""
    rss_reset = reset_peak_rss()
    meter = StageMeter()
    peaks = {}
    t0 = time.perf_counter()

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
    ahead = {
        name: BytesRead(bytes=stats.bytes, seconds=stats.seconds) for name, stats in pipe.prefetch.finished.items()
    }
    pipe = prepared = job = None  # the models go before the next run loads its own
    gc.collect()
    mx.clear_cache()
    stages = {
        name: Stage(seconds=v["seconds"], read_bytes=v["read_bytes"], peak_memory=peaks[name])
        for name, v in meter.stages.items()
    }
    return ColdRun(
        seconds=total,
        stages=stages,
        read_ahead=ahead,
        io_source=meter.source,
        peak_memory=max(peaks.values()),
        peak_rss=peak_rss(),
        peak_rss_of_run=rss_reset,
    )


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


def import_seconds() -> dict[str, float]:
    """Wall time of a fresh Python importing what `generate` imports, and what a run of the text
    encoder adds (mlx_lm, which imports transformers and torch)."""
    imports = {
        "generate": "import flux_klein_mlx.generate",
        "+ the text encoder's": "import flux_klein_mlx.generate, mlx_lm.models.qwen3, transformers",
    }
    out = {}
    for name, code in imports.items():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        out[name] = time.perf_counter() - t0
    return out


def _runs(
    model, *, settings: RunSettings, files: list[Path], dropped: bool, load_settings: dict, log
) -> dict[str, ColdRun]:
    """The runs of `RUNS` in turn, each in a fresh pipeline, with the page cache dropped where the run asks."""
    runs = {}
    with tempfile.TemporaryDirectory(prefix="flux-klein-cold-") as folder:
        shared = EmbeddingCache(folder)
        for plan in RUNS:
            if plan.drop_page_cache:
                drop_from_page_cache(files)
            cache = shared if plan.prompt_cache else False
            run = one_run(
                model,
                dataclasses.replace(settings, seed=plan.seed),
                cache=cache,
                read_ahead=plan.read_ahead,
                **load_settings,
            )
            if not plan.drop_page_cache:
                run.page_cache = "warm"
            else:
                run.page_cache = "dropped" if dropped else "not dropped"
            runs[plan.name] = run
            log(f"{plan.name}: {run.seconds:.2f} s")
    return runs


def _peak(machine: dict, dtype: str) -> Peak:
    """The chip's published peak where known, else a matmul measured here."""
    published = machine["peak_tflops"] * 1e12 if machine["peak_tflops"] else None
    if published:
        return Peak(flops=published, source="published peak of this chip")
    return Peak(flops=matmul_rate(as_dtype(dtype)), source=f"measured {dtype} matmul (2048^3) here")


def measure_cold(
    model,
    *,
    width: int = 256,
    height: int = 256,
    steps: int = 1,
    dtype: str = DEFAULT_DTYPE,
    quantize: int | None = None,
    vae=None,
    log: Callable[[str], None] = lambda msg: None,
) -> ColdResult:
    """Every measurement of the module docstring (`format_cold` prints it)."""
    settings = RunSettings(PROMPT, width=width, height=height, steps=steps).check()  # before any work
    info = describe(model, vae=vae)
    files = sorted({f for n in LOAD_ORDER for f in info.files[n]} | set(info.decoder_files or []))
    files += sorted(p for p in Path(info.tokenizer).glob("*") if p.is_file())
    machine = machine_info()
    imports = import_seconds()
    page_cache = drop_from_page_cache(files)
    dropped = page_cache.startswith("dropped")
    rate = sequential_read_rate([s for n in LOAD_ORDER for s in component_spans(info, n)])
    log(f"sequential read: {rate.bytes / 1e9:.2f} GB at {rate.rate / 1e9:.2f} GB/s ({page_cache})")
    # Imports happen once per process, not once per run here (`import_seconds` has their cost): made
    # now, so that no run below pays them and the runs compare what a run does.
    importlib.import_module("mlx_lm.models.qwen3")
    load_tokenizer(info.tokenizer)
    runs = _runs(
        model,
        settings=settings,
        files=files,
        dropped=dropped,
        load_settings=dict(dtype=dtype, quantize=quantize, vae=vae),
        log=log,
    )
    peak = _peak(machine, dtype)
    flops = stage_flops(info, width=width, height=height, steps=steps, settings=settings)
    load_bytes = {n: bytes_to_load(info, n) for n in LOAD_ORDER}
    return ColdResult(
        model=str(model),
        machine=machine,
        imports=imports,
        settings=Settings(
            width=width,
            height=height,
            steps=steps,
            dtype=dtype,
            quantize=quantize,
            vae=None if vae is None else str(vae),
        ),
        bytes=load_bytes,
        page_cache=page_cache,
        read=SequentialRead(bytes=rate.bytes, seconds=rate.seconds, rate=rate.rate, cold=dropped),
        runs=runs,
        peak=peak,
        flops=flops,
        limits=limits(runs, load_bytes=load_bytes, rate=rate.rate, peak=peak.flops, f=flops),
        second=SecondRun(
            vs_cold=runs["second"].seconds / runs["cold"].seconds, vs_warm=runs["second"].seconds / runs["warm"].seconds
        ),
    )


def stage_flops(info, *, width: int, height: int, steps: int, settings: RunSettings | None = None) -> StageFlops:
    """The FLOPs of each stage of one image of the model `info` describes: its family's text window for a
    typical prompt through its deepest tap, once per prompt of `settings`; one pass per prompt each step
    (CFG: 2)."""
    family = info.family
    prompts = 1 if settings is None else len(prepare_inputs(settings, info).prompts)
    window = family.text_window.length(REAL_PROMPT_TOKENS)
    text = flops_of_text_encoder(
        Qwen3Config.from_dict(info.configs["text_encoder"]), layers=max(family.text_taps), tokens=window
    )
    step, once = denoise_flops(
        family.key, info.params, image_tokens=math.prod(token_grid(width, height)), text_tokens=[window] * prompts
    )
    return StageFlops(
        text_encoder=text.total * prompts,
        denoise=step.total * steps + once.total,
        decode=flops_of_vae_decoder(AutoEncoderConfig.from_dict(info.configs["vae"]), width, height).total,
    )


LOADS = ("load() + checks", "text encoder load", "tokenizer load", "transformer load", "VAE load")


def limits(
    runs: dict[str, ColdRun], *, load_bytes: dict[str, int], rate: float, peak: float, f: StageFlops
) -> dict[str, Limit]:
    """Each cold run against `bytes / rate + compute` (compute: the warm twin's measured compute, and
    FLOPs / peak)."""
    out = {}
    for cold, warm, encodes in LIMITED:
        parts = LOAD_ORDER if encodes else LOAD_ORDER[1:]
        nbytes = sum(load_bytes[n] for n in parts)
        read = nbytes / rate
        flops = f.denoise + f.decode + (f.text_encoder if encodes else 0.0)
        measured = runs[cold].seconds
        # the warm run's time less its loads and checks: encode, denoise and decode
        warm_compute = sum(v.seconds for k, v in runs[warm].stages.items() if k not in LOADS)
        physics = read + flops / peak
        out[cold] = Limit(
            bytes=nbytes,
            read_seconds=read,
            warm_compute_seconds=warm_compute,
            limit_seconds=read + warm_compute,
            ratio=measured / (read + warm_compute),
            flops=flops,
            physics_seconds=physics,
            physics_ratio=measured / physics,
        )
    return out


def format_cold(r: ColdResult) -> str:
    """The result as tables for people (the JSON has every number)."""
    gb = 1e9
    s = r.settings
    m = r.machine
    title = f"time to first image: {r.model}, {s.width}x{s.height}, {s.steps} step(s), {s.dtype}"
    title += (f", {s.quantize}-bit" if s.quantize else "") + (f", VAE {s.vae}" if s.vae else "")
    lines = [
        title,
        f"{m['cpu']} ({m['cpu_cores']} cores, {m['memory_gb']} GB), MLX {m['mlx']} on {m['device']}; "
        f"page cache: {r.page_cache}",
        "bytes each load reads: " + ", ".join(f"{n.replace('_', ' ')} {v / gb:.2f} GB" for n, v in r.bytes.items()),
        f"sequential read of those bytes{' (cold)' if r.read.cold else ' (NOT cold)'}: {r.read.bytes / gb:.2f} GB in "
        f"{r.read.seconds:.2f} s = {r.read.rate / gb:.2f} GB/s",
        "process start + imports (child process): " + ", ".join(f"{k} {v:.2f} s" for k, v in r.imports.items()),
        "",
    ]
    lines += stage_table(r.runs)
    lines.append("")
    for name, lim in r.limits.items():
        lines.append(
            f"{name}: {r.runs[name].seconds:.2f} s = {lim.ratio:.2f}x (bytes / rate + warm compute = "
            f"{lim.read_seconds:.2f} + {lim.warm_compute_seconds:.2f} s), {lim.physics_ratio:.2f}x "
            f"(bytes / rate + FLOPs / peak = {lim.read_seconds:.2f} + {lim.flops / r.peak.flops:.2f} s; "
            f"peak {r.peak.flops / 1e9:.0f} GFLOPS, {r.peak.source})"
        )
    lines.append(
        f"second run (same prompt, another seed): {r.second.vs_cold:.2f}x the cold first run, "
        f"{r.second.vs_warm:.2f}x the warm one"
    )
    return "\n".join(lines)


def stage_table(runs: dict[str, ColdRun]) -> list[str]:
    """A markdown table: a row per stage, a column per run, then totals, peaks and what was read ahead."""
    gb = 1e9
    names = list(runs)
    lines = ["| stage | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for stage in dict.fromkeys(k for run in runs.values() for k in run.stages):
        cells = []
        for n in names:
            v = runs[n].stages.get(stage)
            read = "" if v is None or v.read_bytes is None else f" ({v.read_bytes / gb:.2f} GB read)"
            cells.append("-" if v is None else f"{v.seconds:.2f} s{read}")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(f"**{runs[n].seconds:.2f} s**" for n in names) + " |")
    lines.append("| peak MLX memory | " + " | ".join(f"{runs[n].peak_memory / gb:.2f} GB" for n in names) + " |")
    lines.append(
        "| peak RSS"
        + ("" if runs[names[0]].peak_rss_of_run else " (process, so far)")
        + " | "
        + " | ".join(f"{runs[n].peak_rss / gb:.2f} GB" for n in names)
        + " |"
    )
    ahead = [", ".join(f"{k} {v.bytes / gb:.2f} GB" for k, v in runs[n].read_ahead.items()) or "-" for n in names]
    lines.append("| read ahead | " + " | ".join(ahead) + " |")
    return lines
