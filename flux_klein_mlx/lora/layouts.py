"""The one writer of adapter files (`adapter_file`): LoRA pairs in the three layouts other tools load
(diffusers, ComfyUI, kohya) and LoKr factors in two (ComfyUI/LyCORIS, diffusers), for the trainer's
output, its checkpoints, EMA and sample files and `lora convert` alike; and the reader back (`read_adapter`).

The input is a list of `Term`s (formats.py): updates `factor · up @ down` on row ranges of our
(BFL-named) layers, as `parse_lora` reads them from any file and as the trainer's adapters are.
Each layout has its own unit, the module one (down, up) pair is written for:

    diffusers  transformer.<diffusers module>.lora_A.weight / .lora_B.weight      (r, in) / (out, r)
               a double block's fused qkv is three modules (to_q, to_k, to_v: row blocks of it);
               alpha / r folded into B, PEFT's `lora_adapter_metadata` header with lora_alpha = r
               (ComfyUI's loader ignores that header: a file whose scale lived there had another
               effect there); the trainer's checkpoints alone keep B and alpha apart (fold_alpha=False),
               so a resume reads back the very values it trained
    comfyui    diffusion_model.<BFL module>.lora_A.weight / .lora_B.weight         alpha / r folded into B
    kohya      lora_unet_<BFL module, dots as _>.lora_down.weight / .lora_up.weight / .alpha

Terms that share a unit become one pair: their down matrices stacked (rank r1 + r2 + ...) and
their up matrices placed block-diagonally at their rows (q, k, v: rows [0:D], [D:2D], [2D:3D]), so
`up @ down` is exactly the sum of their updates. A term wider than a unit (a fused qkv written for
diffusers) gives each unit its rows, with the rank columns that are zero there dropped (exact:
those columns add nothing to these rows). ComfyUI and diffusers' converter of BFL names take alpha
= rank (no `.alpha` keys), so the factor goes into B; kohya keeps the matrices and writes
`.alpha` = factor · rank. LoKr terms are not low-rank pairs: `lokr_tensors` writes them (one
Kronecker product per whole layer; LyCORIS' encoding in the ComfyUI layout, which the trainer's
checkpoints use and read back bit for bit).
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checks import check_choice
from ..errors import FluxKleinError, first_few
from ..storage.weights import read_lora_file, save_safetensors_streaming
from .formats import Term, parse_lora
from .names import diffusers_modules, layer_shapes, lora_family, target_table

LAYOUTS = ("diffusers", "comfyui", "kohya")
# What the layouts are called in messages and `lora info` (formats.py's names -> words).
FORMAT_NAMES = {"diffusers": "diffusers / PEFT", "bfl": "BFL names (ComfyUI / ai-toolkit)",
                "peft_bfl": "PEFT-wrapped BFL names", "kohya": "kohya / musubi-tuner",
                "lokr": "LyCORIS LoKr"}  # fmt: skip


def check_layout(layout) -> None:
    """One line saying which layouts exist, unless `layout` is one of them (--format)."""
    check_choice("--format", layout, LAYOUTS)


# --- the units of each layout ---------------------------------------------------------------------


def diffusers_units(params) -> dict[str, list[tuple[str, tuple[int, int], bool]]]:
    """Our layer -> the diffusers modules that exist in diffusers' Flux2 model on it:
    (name, rows of our layer, rows in diffusers' [scale ; shift] order)."""
    table = target_table(params)
    units: dict[str, list] = {}
    for name in diffusers_modules(params):
        t = table[name]
        units.setdefault(t.layer, []).append((name, t.rows, t.swap))
    return units


def whole_layer_units(params) -> dict[str, tuple[str, bool]]:
    """Our layer -> the one diffusers module that is all of it, and its swap: the module itself, or for a
    double block's fused qkv diffusers' fused `to_qkv` / `to_added_qkv` (what its LoKr loader fuses)."""
    units = diffusers_units(params)
    out = {layer: (parts[0][0], parts[0][2]) for layer, parts in units.items() if len(parts) == 1}
    for i in range(params.depth):
        for theirs, ours in lora_family(params).fused.items():
            if f"double_blocks.{i}.{ours}" in units:  # FLUX.2's; FLUX 3 has no fused layer
                out[f"double_blocks.{i}.{ours}"] = (f"transformer_blocks.{i}.{theirs}", False)
    return out


def _restrict(t: Term, rows: tuple[int, int]) -> tuple[int, np.ndarray, np.ndarray, float]:
    """The part of term `t` on unit rows [u0, u1): (row offset in the unit, down (r, in), up (rows, r), factor).

    When the term reaches beyond the unit, rank columns of up that are all zero on these rows are
    dropped with their rows of down (exact), so a block-diagonal fused qkv gives back q, k, v at rank r.
    """
    lo, hi = max(t.rows[0], rows[0]), min(t.rows[1], rows[1])
    down = np.asarray(t.down.astype(mx.float32))
    up = np.asarray(t.up[lo - t.rows[0] : hi - t.rows[0]].astype(mx.float32))
    if (lo, hi) != t.rows:
        used = np.any(up != 0, axis=0)
        if 0 < used.sum() < used.size:
            down, up = down[used], up[:, used]
    return lo - rows[0], down, up, t.factor


def _combine(parts: list, height: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Parts of one unit -> one (down, up, factor): downs stacked, ups block-diagonal at their rows.
    One factor when all agree; else each up carries its own and the factor is 1."""
    factors = {f for *_, f in parts}
    same = len(factors) == 1
    rank = sum(down.shape[0] for _, down, _, _ in parts)
    up = np.zeros((height, rank), np.float32)
    downs, col = [], 0
    for offset, down, part_up, factor in parts:
        r = down.shape[0]
        up[offset : offset + part_up.shape[0], col : col + r] = part_up if same else part_up * factor
        downs.append(down)
        col += r
    return np.concatenate(downs, axis=0), up, factors.pop() if same else 1.0


def layout_pairs(terms: list[Term], layout: str, params, what: str) -> list[tuple[str, mx.array, mx.array, float]]:
    """`terms` -> [(unit name, down, up, factor)] for `layout`, in model order. Pairs left as they
    were (one term, one unit) keep their arrays and dtype; combined ones are float32."""
    check_layout(layout)
    lokr = next((t for t in terms if t.down is None), None)
    if lokr is not None:
        raise FluxKleinError(
            f"LoRA {what} is a LoKr (Kronecker factors, e.g. {lokr.key}), which a plain LoRA file cannot hold; "
            "use it as it is (--lora reads it)"
        )
    shapes = layer_shapes(params)
    by_layer: dict[str, list[Term]] = {}
    for t in terms:
        by_layer.setdefault(t.layer, []).append(t)
    units = diffusers_units(params) if layout == "diffusers" else {}
    pairs = []
    for layer in shapes:  # model order
        if layer not in by_layer:
            continue
        for name, rows, swap in units.get(layer, [(layer, (0, shapes[layer][0]), False)]):
            hit = sorted(
                (t for t in by_layer[layer] if t.rows[0] < rows[1] and rows[0] < t.rows[1]), key=lambda t: t.rows
            )
            if not hit:
                continue
            if len(hit) == 1 and hit[0].rows == rows:
                down, up, factor = hit[0].down, hit[0].up, hit[0].factor
            else:
                down, up, factor = _combine([_restrict(t, rows) for t in hit], rows[1] - rows[0])
                down, up = mx.array(down), mx.array(up)
            if swap:  # our [shift ; scale] -> diffusers' [scale ; shift]
                up = mx.roll(up, up.shape[0] // 2, axis=0)
            pairs.append((name, down, up, factor))
    return pairs


def lokr_tensors(terms: list[Term], layout: str, *, params, what: str, dtype=None) -> dict[str, mx.array]:
    """A LoKr's `terms` as a file in `layout`, one Kronecker product per whole layer:
    comfyui    `diffusion_model.<BFL layer>.lokr_w1` (a, b) with `.lokr_w2` (c, d), or LyCORIS' low-rank
               `.lokr_w2_a` (c, r) + `.lokr_w2_b` (r, d) and `.alpha` = factor · r (what LyCORIS writes,
               read by ComfyUI, ai-toolkit and diffusers' BFL LoKr converter; the trainer's checkpoints)
    diffusers  `transformer.<diffusers module>.lokr_w1` / `.lokr_w2` (or `_a` / `_b`), the module diffusers'
               fused `to_qkv` / `to_added_qkv` on a qkv layer; no alpha: scale 1 (diffusers runs peft's
               LoKr with alpha = rank), so the factor goes into w1.
    A whole w2 takes the factor into w1 (LyCORIS' scale is 1 there), to `dtype`'s rounding (None: w1's)."""
    check_layout(layout)
    if layout == "kohya":
        raise FluxKleinError(
            f"LoRA {what} is a LoKr, which --format kohya cannot hold; --format comfyui writes it "
            "(ComfyUI and ai-toolkit load that layout), as does --format diffusers"
        )
    shapes = layer_shapes(params)
    units = whole_layer_units(params) if layout == "diffusers" else {}
    out: dict[str, mx.array] = {}
    for t in terms:
        if t.down is not None:
            raise FluxKleinError(
                f"LoRA {what} mixes LoKr factors and low-rank pairs ({t.key}); use it as it is (--lora reads it)"
            )
        name, swap = units.get(t.layer, (t.layer, False)) if layout == "diffusers" else (t.layer, False)
        key = f"transformer.{name}" if layout == "diffusers" else f"diffusion_model.{name}"
        if f"{key}.lokr_w1" in out or t.rows != (0, shapes[t.layer][0]) or t.layer not in units and units:
            raise FluxKleinError(
                f"LoRA {what}: the LoKr {t.key} updates part of layer {t.layer} (rows {t.rows[0]}-{t.rows[1]}), "
                f"which a {layout} LoKr (one per whole layer) cannot hold; use it as it is (--lora reads it)"
            )
        out.update(_lokr_factors(t, key, roll=t.swap != swap, alpha=layout == "comfyui", what=what, dtype=dtype))
    return out


def _lokr_factors(t: Term, key: str, *, roll: bool, alpha: bool, what: str, dtype) -> dict[str, mx.array]:
    """One LoKr term's tensors under `key`: w2 whole or as the term's low-rank pair; the factor as `.alpha`
    beside a pair where `alpha`, else in w1; w1's rows rolled where `roll` (our [shift ; scale] <-> the
    other order: rows i·c + j of kron(w1, w2) move with w1's rows i)."""
    cast = dtype or t.w1.dtype
    pair = t.w2_a is not None
    w1 = t.w1 if pair and alpha else t.w1.astype(mx.float32) * t.factor
    if roll:
        if w1.shape[0] % 2:
            raise FluxKleinError(
                f"LoRA {what}: the LoKr {t.key} cannot be written on BFL's [shift ; scale] order "
                f"(its w1 has {w1.shape[0]} rows, not an even number); use it as it is"
            )
        w1 = mx.roll(w1, w1.shape[0] // 2, axis=0)
    out = {f"{key}.lokr_w1": w1.astype(cast)}
    if not pair:
        out[f"{key}.lokr_w2"] = t.w2.astype(cast)
        return out
    out[f"{key}.lokr_w2_a"] = t.w2_a.astype(cast)
    out[f"{key}.lokr_w2_b"] = t.w2_b.astype(cast)
    if alpha:
        out[f"{key}.alpha"] = mx.array(t.factor * t.w2_b.shape[0], dtype=cast)  # LyCORIS' scale: alpha / r
    return out


# --- the files -----------------------------------------------------------------------------------


def layout_tensors(pairs, layout: str, dtype=None) -> dict[str, mx.array]:
    """The file's tensors for `pairs` (from `layout_pairs`), in `dtype` (None: each pair's own)."""
    out = {}
    for name, down, up, factor in pairs:
        cast = dtype or down.dtype
        if layout == "diffusers":
            out[f"transformer.{name}.lora_A.weight"] = down.astype(cast)
            out[f"transformer.{name}.lora_B.weight"] = up.astype(cast)
        elif layout == "comfyui":
            folded = up if factor == 1.0 else up.astype(mx.float32) * factor
            out[f"diffusion_model.{name}.lora_A.weight"] = down.astype(cast)
            out[f"diffusion_model.{name}.lora_B.weight"] = folded.astype(cast)
        else:
            stem = "lora_unet_" + name.replace(".", "_")
            out[f"{stem}.lora_down.weight"] = down.astype(cast)
            out[f"{stem}.lora_up.weight"] = up.astype(cast)
            out[f"{stem}.alpha"] = mx.array(factor * down.shape[0], dtype=mx.float32)
    return out


def peft_metadata(pairs) -> str:
    """diffusers' `lora_adapter_metadata` for diffusers-layout `pairs`: PEFT's LoraConfig with every key
    prefixed `transformer.`; the most common rank and alpha, and patterns for the modules that differ."""
    ranks = {name: down.shape[0] for name, down, _, _ in pairs}
    alphas = {name: factor * down.shape[0] for name, down, _, factor in pairs}
    r = collections.Counter(ranks.values()).most_common(1)[0][0]
    alpha = collections.Counter(alphas.values()).most_common(1)[0][0]
    config = {
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(ranks),
        "peft_type": "LORA",
        "bias": "none",
        "rank_pattern": {n: v for n, v in ranks.items() if v != r},
        "alpha_pattern": {n: v for n, v in alphas.items() if v != alpha},
        "use_dora": False,
        "use_rslora": False,
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
    }
    return json.dumps({f"transformer.{k}": v for k, v in config.items()}, indent=2, sort_keys=True)


# Header keys a converted file does not keep from its source: they describe the source's layout.
_LAYOUT_KEYS = ("format", "lora_adapter_metadata", "lora_alpha", "lora_rank")


def file_metadata(pairs, layout: str, header: dict[str, str] | None = None) -> dict[str, str]:
    """The safetensors header of a `layout` file: `header` (the training's or the source's keys,
    less the source's layout keys), the layout, and PEFT's config for diffusers' LoRA pairs."""
    meta = {k: str(v) for k, v in (header or {}).items() if k not in _LAYOUT_KEYS and v is not None}
    meta["format"] = "pt"
    meta["flux_klein_mlx.format"] = layout
    if layout == "diffusers" and pairs:
        meta["lora_adapter_metadata"] = peft_metadata(pairs)
    return meta


def adapter_file(
    terms: list[Term],
    layout: str,
    params,
    *,
    what: str,
    dtype=None,
    header: dict[str, str] | None = None,
    fold_alpha: bool = True,
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """THE writer of adapter files: any adapter's `terms` (LoRA pairs or LoKr factors, as `parse_lora`
    reads them and as the trainer holds them) as (tensors, safetensors header) in `layout`, tensors in
    `dtype` (None: each term's own). The trainer's output, checkpoints, EMA and sample files and
    `lora convert` all come from here; `header` adds the training's or the source's keys. A diffusers
    file has alpha folded into B (`fold_alpha`; the checkpoints' exact layout keeps them apart)."""
    if any(t.down is None for t in terms):
        return lokr_tensors(terms, layout, params=params, what=what, dtype=dtype), file_metadata([], layout, header)
    pairs = layout_pairs(terms, layout, params, what)
    if layout == "diffusers" and fold_alpha:  # every loader then gives the same effect: alpha = r, scale 1
        pairs = [(name, down, up if f == 1.0 else up.astype(mx.float32) * f, 1.0) for name, down, up, f in pairs]
    return layout_tensors(pairs, layout, dtype), file_metadata(pairs, layout, header)


def write_adapter(path: Path, terms: list[Term], layout: str, params, **kwargs) -> Path:
    """`adapter_file(terms, layout, params, **kwargs)` written at `path` (the caller picks the safe write)."""
    tensors, metadata = adapter_file(terms, layout, params, **kwargs)
    save_safetensors_streaming(path, tensors, metadata=metadata)
    return path


def file_shapes(terms: list[Term], layout: str, params) -> dict[str, tuple[int, ...]]:
    """The tensors `adapter_file` would write for `terms`, name -> shape. MLX is lazy: terms of
    `mx.zeros` give the shapes without computing (or allocating) any tensor."""
    tensors, _ = adapter_file(terms, layout, params, what="the adapters")
    return {k: tuple(v.shape) for k, v in tensors.items()}


def read_adapter(path: Path, params, what: str) -> list[Term]:
    """An adapter file read back as the terms it was written from (`parse_lora`, the reader of --lora):
    the factors exactly as stored. Modules that fit no layer of `params` are refused."""
    tensors, metadata, _ = read_lora_file(path)
    parsed = parse_lora(tensors, metadata, params, what)
    if parsed.unmatched:
        raise FluxKleinError(
            f"{what} holds adapters of no layer of {params.describe()} ({first_few(parsed.unmatched)}): "
            "it is from another run"
        )
    return parsed.terms


def autov3(path: str | Path) -> str:
    """A1111's hash of a LoRA file (its `addnet_hash_safetensors`, Civitai's AutoV3): the sha256 of the
    tensor data after the safetensors header, so that editing the header's metadata keeps it. First 12 hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:12]


# --- what a trained file says about its training -------------------------------------------------------

# klein variant -> (kohya's ss_base_model_version as musubi-tuner writes it, modelspec architecture)
_KOHYA_BASE = {"klein-4b": ("flux_2_klein_4b", "Flux.2-klein-4b"), "klein-9b": ("flux_2_klein_9b", "Flux.2-klein-9b")}


def tag_frequency(captions: list[str]) -> dict[str, int]:
    """kohya's tag count: each caption split at commas, tags stripped, counted once per caption."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in dict.fromkeys(t.strip() for t in caption.split(",")):
            if tag:
                counts[tag] = counts.get(tag, 0) + 1
    return counts


@dataclass(frozen=True, kw_only=True)
class TrainedRun:
    """What a trained adapter's header records of its run. `started`/`finished` are unix times; `captions`
    are the training captions, one per image; `resolutions` every training size (square, px)."""

    name: str
    adapter: str  # "lora" or "lokr"
    lokr_factor: int | None  # LoKr: the --lokr-factor the run split each width with (None for LoRA)
    rank: int
    alpha: float
    base_model: str
    variant: str
    trigger: str | None  # the trigger the captions were trained with
    settings_hash: str
    resolutions: tuple[int, ...]
    max_steps: int
    steps: int
    lr: float
    lr_scheduler: str  # diffusers' get_scheduler name, as kohya writes its own
    warmup_steps: int
    captions: list[str]
    dataset: str
    seed: int
    batch_size: int
    grad_accum: int
    dtype: str
    started: float
    finished: float
    version: str


def kohya_resolution(sizes: tuple[int, ...]) -> str:
    """kohya's `ss_resolution`: sd-scripts writes its one `(W, H)` tuple as Python prints it, "(512, 512)".
    Several sizes (kohya trains those as one dataset per size, in `ss_datasets`) are each written so, comma
    separated: "(512, 512), (768, 768)", which Python's `ast.literal_eval` reads as a tuple of (W, H)."""
    return ", ".join(f"({size}, {size})" for size in sizes)


def network_keys(run: TrainedRun) -> dict[str, str]:
    """kohya's keys of the adapter kind: LoRA is kohya's `networks.lora`; a LoKr is LyCORIS' kohya network,
    with its algorithm and factor as kohya records `--network_args` (each value a string)."""
    if run.adapter == "lokr":
        return {
            "ss_network_module": "lycoris.kohya",
            "ss_network_args": json.dumps({"algo": "lokr", "factor": str(run.lokr_factor)}),
        }
    return {"ss_network_module": "networks.lora"}


def training_header(run: TrainedRun) -> dict[str, str]:
    """The header of a trained adapter: our keys, kohya's `ss_*` training keys (A1111's LoRA cards, Civitai and
    ComfyUI's LoRA info read them) and the SAI model spec's `modelspec.*`, in every layout. The model spec
    has one resolution ("the base resolution ... intended to work at"): the largest trained size; its
    architecture ends in the adapter kind, `/lora` or `/lokr` (the spec asks an ID to differ wherever the
    inference code does; kohya writes `/lora` for any network, LyCORIS' too)."""
    kohya_base, arch = _KOHYA_BASE.get(run.variant, ("flux_2_klein", "Flux.2-klein"))
    captions, largest = run.captions, max(run.resolutions)
    header = {
        "flux_klein_mlx.version": run.version,
        "flux_klein_mlx.rank": run.rank,
        "flux_klein_mlx.alpha": run.alpha,
        "flux_klein_mlx.base_model": run.base_model,
        "flux_klein_mlx.trigger": run.trigger,
        "flux_klein_mlx.settings_sha256": run.settings_hash,
        "ss_base_model_version": kohya_base,
        "ss_sd_model_name": run.base_model,
        **network_keys(run),
        "ss_network_dim": run.rank,
        "ss_network_alpha": run.alpha,
        "ss_resolution": kohya_resolution(run.resolutions),
        "ss_max_train_steps": run.max_steps,
        "ss_steps": run.steps,
        "ss_learning_rate": run.lr,
        "ss_lr_scheduler": run.lr_scheduler,
        "ss_lr_warmup_steps": run.warmup_steps,
        "ss_optimizer": "AdamW",
        "ss_num_train_images": len(captions),
        "ss_batch_size_per_device": run.batch_size,
        "ss_gradient_accumulation_steps": run.grad_accum,
        "ss_seed": run.seed,
        "ss_mixed_precision": run.dtype,
        "ss_output_name": run.name,
        "ss_training_started_at": run.started,
        "ss_training_finished_at": run.finished,
        "ss_tag_frequency": json.dumps({run.dataset: tag_frequency(captions)}),
        "ss_dataset_dirs": json.dumps({run.dataset: {"n_repeats": 1, "img_count": len(captions)}}),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{arch}/{run.adapter}",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux2",
        "modelspec.title": run.name,
        "modelspec.resolution": f"{largest}x{largest}",
        "modelspec.trigger_phrase": run.trigger,
        "modelspec.date": datetime.fromtimestamp(int(run.finished), timezone.utc).isoformat(),
    }
    return {k: str(v) for k, v in header.items() if v is not None}
