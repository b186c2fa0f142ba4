"""LoRA files as wholes, without a model: which klein they fit (from their shapes), what their header
says (trainer, base model, trigger), and converting one into another layout (`lora convert`, `lora info`).

A LoRA file does not name its model, but its shapes do: the input width of most modules is the
hidden size D (3072 klein-4B, 4096 klein-9B), block indices give the block counts, and `img_in`,
`txt_in` and `time_in` give their own widths when present. From those a `FluxKleinParams` is built
and the file is read exactly as `--lora` reads it (formats.parse_lora), so a file converts only
when every module lands on a layer. A file whose names are FLUX 3 Image Klein's (`names.family_of_names`)
gets a `Flux3Params` the same way (the distilled model when it adapts `ref_time_in`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..errors import FluxKleinError, first_few
from ..storage.files import check_output_file, write_exclusive
from ..storage.weights import read_lora_file, save_safetensors_streaming
from .formats import DOWN_ROLES, ParsedLora, parse_lora
from .layouts import FORMAT_NAMES, adapter_file, autov3, check_layout
from .names import family_of_names, lora_family, unmarked_lora

# a LoRA down matrix's key ending (PEFT's adapter name optional): `.lora_A.weight`, `.lora_down.weight`, ...
_DOWN = re.compile(rf"\.(?:{'|'.join(re.escape(r) for r in DOWN_ROLES)})(?:\.[A-Za-z0-9_]+)?\.weight$")


def _input_widths(tensors: dict[str, mx.array]) -> dict[str, int]:
    """Module key -> input width of its down matrix (LoKr: w1's columns x w2's columns)."""
    widths = {k: v.shape[1] for k, v in tensors.items() if _DOWN.search(k) and v.ndim == 2}
    for k, v in tensors.items():
        m = re.match(r"(.+)\.lokr_w1(_b)?$", k)
        w2 = tensors.get(f"{m.group(1)}.lokr_w2", tensors.get(f"{m.group(1)}.lokr_w2_b")) if m else None
        if w2 is not None and v.ndim == 2 and w2.ndim == 2:
            widths[m.group(1)] = v.shape[1] * w2.shape[1]
    return widths


@dataclass(kw_only=True)
class LoraFile:
    """A LoRA file read and mapped onto the transformer its shapes describe."""

    path: Path
    metadata: dict[str, str]
    sha256: str  # of the whole file
    parsed: ParsedLora
    params: object  # the family's transformer hyper-parameters
    dtype: mx.Dtype  # of its matrices


def read_any_lora(path: str | Path) -> LoraFile:
    """Read any LoRA file `--lora` reads; one FluxKleinError line for a damaged, foreign or partly matching file."""
    path = Path(path).expanduser()
    tensors, metadata, sha = read_lora_file(path)
    what = path.name
    floats = {k: v for k, v in tensors.items() if mx.issubdtype(v.dtype, mx.floating)}
    bad = next((k for k, v in floats.items() if not mx.all(mx.isfinite(v)).item()), None)
    if bad:
        raise FluxKleinError(f"LoRA {what} holds non-finite values (in {bad}); the file is damaged")
    first_error = None
    made = family_of_names(tensors)  # the unmarked family's when no name tells (names both families have)
    widths = {re.sub(_DOWN, "", k): w for k, w in _input_widths(tensors).items()}
    for params in (made[0] if made else unmarked_lora()).guess(list(tensors), widths):
        try:
            parsed = parse_lora(tensors, metadata, params, what)
        except FluxKleinError as e:  # shapes of another candidate, or a foreign / damaged file
            first_error = first_error or e
            continue
        if parsed.terms and not parsed.unmatched:
            dtype = next((v.dtype for v in tensors.values() if v.ndim == 2), mx.float32)
            return LoraFile(path=path, metadata=metadata, sha256=sha, parsed=parsed, params=params, dtype=dtype)
        first_error = first_error or FluxKleinError(
            f"LoRA {what}: {len(parsed.unmatched)} of its {parsed.n_modules} modules match no "
            f"{lora_family(params).title} layer "
            f"({first_few(parsed.unmatched)}); it is not a klein LoRA, or not one flux_klein_mlx can convert"
        )
    raise first_error


def convert_lora(source: str | Path, output: str | Path, layout: str) -> Path:
    """Write LoRA `source` (any format `--lora` reads) at `output` in `layout`, exactly (the same update
    on every layer, to the source dtype's rounding where alpha is folded). Never overwrites; atomic."""
    check_layout(layout)
    output = Path(output).expanduser()
    if output.suffix.lower() != ".safetensors":
        raise FluxKleinError(f"--output must be a .safetensors file name, not {str(output)!r}")
    if output.exists() or output.is_symlink():
        raise FluxKleinError(f"--output {output} exists and is never overwritten; choose another name")
    check_output_file(output)
    lora = read_any_lora(source)
    header = {
        **lora.metadata,
        "flux_klein_mlx.converted_from": f"{lora.path.name} ({FORMAT_NAMES[lora.parsed.format]})",
    }
    tensors, metadata = adapter_file(
        lora.parsed.terms, layout, lora.params, what=lora.path.name, dtype=lora.dtype, header=header
    )
    return write_exclusive(output, lambda tmp: save_safetensors_streaming(tmp, tensors, metadata))


_TRAINERS = (("flux_klein_mlx.version", "flux_klein_mlx {}"), ("mflux_version", "mflux {}"),
             ("ss_network_module", "kohya sd-scripts / musubi-tuner ({})"),
             ("lora_adapter_metadata", "diffusers / PEFT"), ("modelspec.implementation", "{}"))  # fmt: skip
_BASE = ("flux_klein_mlx.base_model", "ss_sd_model_name", "ss_base_model_version", "modelspec.architecture", "model")


def describe_lora(path: str | Path) -> dict:
    """What `lora info` prints: format, modules, ranks, alphas, trainer / base model / trigger from the
    header, the model its shapes fit, and the file's hashes."""
    lora = read_any_lora(path)
    terms, meta, p = lora.parsed.terms, lora.metadata, lora.params
    ranks = sorted({t.down.shape[0] if t.down is not None else 0 for t in terms})
    alphas = sorted({round(t.factor * t.down.shape[0], 6) for t in terms if t.down is not None})
    trainer = next((fmt.format(meta[k]) if "{}" in fmt else fmt for k, fmt in _TRAINERS if meta.get(k)), None)
    family = lora_family(p)
    size = family.hidden_sizes.get(
        p.hidden_size, f"a {family.title} transformer of hidden size {p.hidden_size} (not a released one)"
    )
    if getattr(p, "flow_map", False):  # FLUX 3: only the distilled model has the target-time embedder
        size += " (distilled: it adapts ref_time_in)"
    trained = trained_rank(meta)
    return {
        "file": str(lora.path),
        "format": FORMAT_NAMES[lora.parsed.format],
        "modules": lora.parsed.n_modules,
        "layers": len({t.layer for t in terms}),
        "ranks": [trained[0]] if trained else ranks,
        "alphas": [trained[1]] if trained else alphas,
        "trained_rank": trained is not None,
        "training": training_facts(meta),
        "lokr": any(t.down is None for t in terms),
        "model": size,
        "dtype": str(lora.dtype).removeprefix("mlx.core."),
        "trainer": trainer,
        "base_model": next((meta[k] for k in _BASE if meta.get(k)), None),
        "trigger": meta.get("flux_klein_mlx.trigger") or meta.get("modelspec.trigger_phrase") or None,
        "sha256": lora.sha256,
        "autov3": autov3(lora.path),
    }


def trained_rank(meta: dict[str, str]) -> tuple[int, float] | None:
    """(rank, alpha) a trainer recorded in the header (ours, else kohya's ss_network_dim / _alpha), or None.
    The file's own pairs can be wider: ComfyUI's fused qkv stacks q, k and v (rank 48 of a rank-16 run)."""
    for rank_key, alpha_key in (
        ("flux_klein_mlx.rank", "flux_klein_mlx.alpha"),
        ("ss_network_dim", "ss_network_alpha"),
    ):
        try:
            rank, alpha = int(float(meta[rank_key])), float(meta[alpha_key])
        except (KeyError, ValueError):
            continue
        if rank > 0 and math.isfinite(alpha):
            return rank, alpha
    return None


def training_facts(meta: dict[str, str]) -> list[tuple[str, str]]:
    """What a trained file's header says of its run (kohya's ss_* keys, which we write too), as
    (label, text) lines of `lora info`; keys that are absent are left out."""
    get = meta.get
    facts = []
    if get("ss_steps") or get("ss_max_train_steps"):
        steps = get("ss_steps") or get("ss_max_train_steps")
        total = f" of {get('ss_max_train_steps')}" if get("ss_steps") and get("ss_max_train_steps") else ""
        facts.append(("steps", f"{steps}{total}"))
    if get("ss_learning_rate"):
        warmup = get("ss_lr_warmup_steps")
        warm = f", warmup {warmup} steps" if warmup and warmup != "0" else ""
        facts.append(("schedule", f"lr {get('ss_learning_rate')} {get('ss_lr_scheduler') or ''}{warm}".strip()))
    if get("ss_resolution"):  # "(512, 512), (768, 768)": each size as kohya writes its one
        sizes = [f"{w}x{h}" for w, h in re.findall(r"\((\d+), (\d+)\)", get("ss_resolution"))]
        facts.append(("sizes", ", ".join(sizes) or get("ss_resolution")))
    if get("ss_num_train_images"):
        facts.append(("dataset", _dataset(get("ss_num_train_images"), get("ss_tag_frequency"))))
    return facts


def _dataset(images: str, tag_frequency: str | None) -> str:
    """ "5 images; tags: sks (5), a fox (2), ..." from kohya's count and its tag frequency (JSON, per folder)."""
    counts: dict[str, int] = {}
    try:
        for tags in json.loads(tag_frequency or "{}").values():
            for tag, n in tags.items():
                counts[tag] = counts.get(tag, 0) + int(n)
    except (ValueError, AttributeError, TypeError):
        counts = {}
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = first_few([f"{t} ({n})" for t, n in top], 5)
    return f"{images} images" + (f"; tags: {shown}" if shown else "")


def describe_number(x: float) -> str:
    """6.0 -> "6", 0.25 -> "0.25"."""
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"
