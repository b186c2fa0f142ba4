"""Writing a LoRA in the three layouts other tools load: diffusers, ComfyUI and kohya.

The input is a list of `Term`s (formats.py): updates `factor · up @ down` on row ranges of our
(BFL-named) layers, as `parse_lora` reads them from any file and as the trainer's adapters are.
Each layout has its own unit, the module one (down, up) pair is written for:

    diffusers  transformer.<diffusers module>.lora_A.weight / .lora_B.weight      (r, in) / (out, r)
               a double block's fused qkv is three modules (to_q, to_k, to_v: row blocks of it);
               alpha in PEFT's `lora_adapter_metadata` header (r, lora_alpha, rank/alpha patterns)
    comfyui    diffusion_model.<BFL module>.lora_A.weight / .lora_B.weight         alpha / r folded into B
    kohya      lora_unet_<BFL module, dots as _>.lora_down.weight / .lora_up.weight / .alpha

Terms that share a unit become one pair: their down matrices stacked (rank r1 + r2 + ...) and
their up matrices placed block-diagonally at their rows (q, k, v: rows [0:D], [D:2D], [2D:3D]), so
`up @ down` is exactly the sum of their updates. A term wider than a unit (a fused qkv written for
diffusers) gives each unit its rows, with the rank columns that are zero there dropped (exact:
those columns add nothing to these rows). ComfyUI and diffusers' converter of BFL names take alpha
= rank (no `.alpha` keys), so the factor goes into B; kohya keeps the matrices and writes
`.alpha` = factor · rank. LoKr terms are not low-rank pairs: `lokr_tensors` writes them, in the
ComfyUI layout only.
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
from ..errors import FluxKleinError
from ..models.transformer import DIFFUSERS_DOUBLE, DIFFUSERS_SINGLE, DIFFUSERS_TOP, QKV, linear_shapes
from .formats import Term, target_table

LAYOUTS = ("diffusers", "comfyui", "kohya")
# What the layouts are called in messages and `lora info` (formats.py's letters -> words).
FORMAT_NAMES = {"A": "diffusers / PEFT", "B": "BFL names (ComfyUI / ai-toolkit)", "C": "PEFT-wrapped BFL names",
                "D": "kohya / musubi-tuner", "E": "LyCORIS LoKr"}  # fmt: skip


def check_layout(layout, option: str = "--format") -> str:
    """The layout name, or one line saying which exist."""
    check_choice(option, layout, LAYOUTS)
    return layout


# --- the units of each layout ---------------------------------------------------------------------


def diffusers_units(params) -> dict[str, list[tuple[str, tuple[int, int], bool]]]:
    """Our layer -> the diffusers modules that exist in diffusers' Flux2 model on it:
    (name, rows of our layer, rows in diffusers' [scale ; shift] order)."""
    table = target_table(params)
    names = [*DIFFUSERS_TOP, "norm_out.linear"]
    for i in range(params.depth):
        names += [f"transformer_blocks.{i}.{p}" for parts in QKV.values() for p in parts]
        names += [f"transformer_blocks.{i}.{m}" for m in DIFFUSERS_DOUBLE if not m.endswith(".weight")]
    for j in range(params.depth_single):
        names += [f"single_transformer_blocks.{j}.{m}" for m in DIFFUSERS_SINGLE if not m.endswith(".weight")]
    units: dict[str, list] = {}
    for name in names:
        t = table[name]
        units.setdefault(t.layer, []).append((name, t.rows, t.swap))
    return units


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
    shapes = linear_shapes(params)
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


def lokr_tensors(terms: list[Term], layout: str, params, what: str, dtype) -> dict[str, mx.array]:
    """A LoKr's `terms` as a ComfyUI LoKr file: `diffusion_model.<BFL layer>.lokr_w1` (a, b) and `.lokr_w2`
    (c, d), with the factor folded into w1 and no `.alpha` (scale 1 in ComfyUI and in diffusers' BFL LoKr
    converter): the same update to `dtype`'s rounding of factor · w1. A Kronecker product covers a whole
    layer, so each term must (one per layer); a [shift ; scale] swap rolls w1's rows (kron's row blocks)."""
    check_layout(layout)
    if layout != "comfyui":
        raise FluxKleinError(
            f"LoRA {what} is a LoKr, which --format {layout} cannot hold; --format comfyui writes it "
            "(ComfyUI, ai-toolkit and diffusers load that layout)"
        )
    shapes = linear_shapes(params)
    out: dict[str, mx.array] = {}
    for t in terms:
        if t.down is not None:
            raise FluxKleinError(
                f"LoRA {what} mixes LoKr factors and low-rank pairs ({t.key}); use it as it is (--lora reads it)"
            )
        if f"diffusion_model.{t.layer}.lokr_w1" in out or t.rows != (0, shapes[t.layer][0]):
            raise FluxKleinError(
                f"LoRA {what}: the LoKr {t.key} updates part of layer {t.layer} (rows {t.rows[0]}-{t.rows[1]}), "
                "which a ComfyUI LoKr (one per whole layer) cannot hold; use it as it is (--lora reads it)"
            )
        w1 = t.w1.astype(mx.float32) * t.factor
        if t.swap:  # our [shift ; scale] halves: rows i·c + j of kron(w1, w2) roll with w1's rows i
            if w1.shape[0] % 2:
                raise FluxKleinError(
                    f"LoRA {what}: the LoKr {t.key} cannot be written on BFL's [shift ; scale] order "
                    f"(its w1 has {w1.shape[0]} rows, not an even number); use it as it is"
                )
            w1 = mx.roll(w1, w1.shape[0] // 2, axis=0)
        out[f"diffusion_model.{t.layer}.lokr_w1"] = w1.astype(dtype)
        out[f"diffusion_model.{t.layer}.lokr_w2"] = t.w2.astype(dtype)
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
    less the source's layout keys), the layout, and PEFT's config for diffusers."""
    meta = {k: str(v) for k, v in (header or {}).items() if k not in _LAYOUT_KEYS and v is not None}
    meta["format"] = "pt"
    meta["flux_klein_mlx.format"] = layout
    if layout == "diffusers":
        meta["lora_adapter_metadata"] = peft_metadata(pairs)
    return meta


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
    """What a trained LoRA's header records of its run. `started`/`finished` are unix times; `captions`
    are the training captions, one per image."""

    name: str
    rank: int
    alpha: float
    base_model: str
    variant: str
    trigger: str | None
    settings_hash: str
    resolution: int
    max_steps: int
    steps: int
    lr: float
    captions: list[str]
    dataset: str
    seed: int
    batch_size: int
    grad_accum: int
    dtype: str
    started: float
    finished: float
    version: str


def training_header(run: TrainedRun) -> dict[str, str]:
    """The header of a trained LoRA: our keys, kohya's `ss_*` training keys (A1111's LoRA cards, Civitai and
    ComfyUI's LoRA info read them) and the SAI model spec's `modelspec.*`, in every layout."""
    kohya_base, arch = _KOHYA_BASE.get(run.variant, ("flux_2_klein", "Flux.2-klein"))
    captions, resolution = run.captions, run.resolution
    header = {
        "flux_klein_mlx.version": run.version,
        "flux_klein_mlx.rank": run.rank,
        "flux_klein_mlx.alpha": run.alpha,
        "flux_klein_mlx.base_model": run.base_model,
        "flux_klein_mlx.trigger": run.trigger,
        "flux_klein_mlx.settings_sha256": run.settings_hash,
        "ss_base_model_version": kohya_base,
        "ss_sd_model_name": run.base_model,
        "ss_network_module": "networks.lora",
        "ss_network_dim": run.rank,
        "ss_network_alpha": run.alpha,
        "ss_resolution": f"({resolution}, {resolution})",
        "ss_max_train_steps": run.max_steps,
        "ss_steps": run.steps,
        "ss_learning_rate": run.lr,
        "ss_lr_scheduler": "constant",
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
        "modelspec.architecture": f"{arch}/lora",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux2",
        "modelspec.title": run.name,
        "modelspec.resolution": f"{resolution}x{resolution}",
        "modelspec.trigger_phrase": run.trigger,
        "modelspec.date": datetime.fromtimestamp(int(run.finished), timezone.utc).isoformat(),
    }
    return {k: str(v) for k, v in header.items() if v is not None}
