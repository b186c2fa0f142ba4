"""LoRA files for klein: which format a file is (from its keys), and what each key does to which of our layers.

Five formats are in use (docs/loras.md#formats); the names differ, the mathematics does not:

    A  diffusers / PEFT   transformer.transformer_blocks.0.attn.to_q.lora_A.weight   alpha: metadata, else rank
    B  BFL names          diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight  alpha: `.alpha` key, else rank
    C  PEFT-wrapped BFL   base_model.model.double_blocks.0.img_attn.qkv.lora_A.weight  as B
    D  kohya / musubi     lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight     alpha: `.alpha` key, else rank
    E  LyCORIS LoKr       double_blocks.0.img_attn.qkv.lokr_w1 (+ lokr_w2, _a/_b)     delta = kron(w1, w2)

Two Mac trainers write A with names of their own, read here too: mflux (`transformer.` prefix,
`attn.to_out` without diffusers' `.0`, `time_guidance_embed.linear_1`; no alpha: alpha = rank) and
flux-2-swift-mlx (no prefix, `ff.activation.proj` for `ff.linear_in`, `attn.to_qkv_mlp`; alpha and
rank as top-level `lora_alpha` / `lora_rank` metadata). SimpleTuner's LyCORIS files are D/E names
with the `lycoris_` prefix.

FLUX 3 Image Klein's LoRAs come in A, B and D with its own module names (docs/loras.md#flux-3-image-klein):
`transformer.mode_blocks.image.0.attn.to_q`, `diffusion_model.content_mode_blocks.image.0.q_proj`,
`lora_unet_single_blocks_0_mlp_in`. Each family's names are its `Family.lora` (family/<family>/lora.py), found
by the type of the model's hyper-parameters; a file whose names belong to another family is refused naming both.

Every key is looked up in one table (`names.target_table`) built from the model's own hyper-parameters:
our (BFL) module paths, diffusers' names, and both written with underscores (kohya/LyCORIS). An entry is a `Target`:
our layer, the rows of its output the named module covers (diffusers' separate q/k/v inside our
fused qkv and `linear1`), and whether the rows come in diffusers' [scale ; shift] order (the final
layer's modulation, ours is [shift ; scale]). The result is a list of `Term`s, each one update
`factor · up @ down` (or `factor · kron(w1, w2)`) for a row range of one layer, with the halves
already in our order. Nothing here touches a model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..errors import FluxKleinError, first_few
from ..models.config import flux1_marker
from ..storage.weights import check_safetensors_file
from .names import Target, family_of_names, layer_shapes, lora_family, target_table

# Module-name prefixes, longest first, and the format they say.
_PREFIXES = (
    ("lora_unet_", "kohya"), ("lora_transformer_", "kohya"), ("lycoris_", "kohya"),
    ("base_model.model.diffusion_model.", "peft_bfl"), ("base_model.model.", "peft_bfl"),
    ("model.diffusion_model.", "bfl"), ("diffusion_model.", "bfl"), ("transformer.", "diffusers"),
)  # fmt: skip
# Key endings -> the role of the tensor. PEFT's adapter name (".default") is optional.
_ROLE = re.compile(
    r"^(?P<module>.+?)\.(?:(?P<lora>lora_[AB]|lora_down|lora_up|lora\.down|lora\.up)(?:\.[A-Za-z0-9_]+)?\.weight"
    r"|(?P<lokr>lokr_w[12](?:_[ab])?|lokr_t[12])|(?P<alpha>alpha)|(?P<other>dora_scale|lora_magnitude_vector.*|"
    r"(?:lora_[AB]|lora_down|lora_up)\.bias|diff|diff_b|hada_w[12]_[ab]))$"
)
DOWN_ROLES = ("lora_A", "lora_down", "lora.down")  # the names of a LoRA's down (A) matrix
# Keys that only UNet models (SDXL, Stable Diffusion) have; FLUX.1's are config.FLUX1_MARKERS.
_UNET_MARKERS = ("down_blocks", "up_blocks", "mid_block", "input_blocks", "output_blocks", "lora_te1_", "lora_te2_",
                 "text_model", "conditioner")  # fmt: skip


@dataclass
class Term:
    """One update of one layer: `factor · up @ down` (or `factor · kron(w1, w2)`) added to rows [r0, r1)."""

    layer: str
    rows: tuple[int, int]
    factor: float  # alpha / rank (LoKr: alpha / rank of its decomposed factor, or 1)
    down: mx.array | None = None  # (r, in)
    up: mx.array | None = None  # (r1 - r0, r), halves already in our order
    w1: mx.array | None = None  # LoKr (a, b)
    w2: mx.array | None = None  # LoKr (c, d); kron(w1, w2) is (a·c, b·d)
    w2_a: mx.array | None = None  # LoKr: w2 as LyCORIS' low-rank pair, w2 = w2_a (c, r) @ w2_b (r, d),
    w2_b: mx.array | None = None  # kept so that a file written again holds the same factors
    swap: bool = False  # LoKr only: roll the output halves (low-rank terms are swapped at parse time)
    key: str = ""  # the module name in the file, for messages

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, in) of the update."""
        if self.down is not None:
            return self.up.shape[0], self.down.shape[1]
        return self.w1.shape[0] * self.w2.shape[0], self.w1.shape[1] * self.w2.shape[1]


@dataclass(kw_only=True)
class ParsedLora:
    """A LoRA file's updates, mapped onto our layers (not yet scaled by the user's strength)."""

    format: str  # "diffusers", "bfl", "peft_bfl", "kohya" or "lokr" (layouts.FORMAT_NAMES says each in words)
    terms: list[Term]
    unmatched: list[str] = field(default_factory=list)  # module names that match no layer
    n_modules: int = 0


def is_adapter_key(key: str) -> bool:
    """A LoRA or LoKr factor's tensor name in any of the layouts above (what makes a file an adapter file)."""
    m = _ROLE.match(key)
    return bool(m and (m["lora"] or m["lokr"]))


def is_lora_file(path) -> bool:
    """Whether the safetensors header of `path` names LoRA or LoKr factors (no tensor is read)."""
    try:
        return any(is_adapter_key(k) for k in check_safetensors_file(Path(path).expanduser()))
    except FluxKleinError:
        return False


# --- reading the keys ---------------------------------------------------------------------------------


def _group(tensors: dict[str, mx.array], what: str) -> tuple[dict[str, dict[str, mx.array]], str]:
    """Keys -> {module name (prefix stripped): {role: tensor}}, and the format it is in."""
    unknown = [key for key in tensors if not _ROLE.match(key)]
    if unknown:
        raise FluxKleinError(
            f"LoRA {what} has {len(unknown)} key(s) that are not LoRA/LoKr weights "
            f"({first_few(unknown)}); is it a model checkpoint?"
        )
    modules: dict[str, dict[str, mx.array]] = {}
    keys: dict[tuple[str, str], str] = {}  # (module, role) -> the key that gave it
    kinds = set()
    for key, value in tensors.items():
        m = _ROLE.match(key)
        if m.group("other"):
            what_ = "DoRA" if "dora" in key or "magnitude" in key else "LoRA bias / LoHa / full-diff"
            raise FluxKleinError(
                f"LoRA {what} holds {what_} weights ({key}), which flux_klein_mlx does not apply; "
                "use a plain LoRA or LoKr"
            )
        name = m.group("module")
        lora = m.group("lora")
        role = ("down" if lora in DOWN_ROLES else "up") if lora else m.group("lokr") or "alpha"
        prefix, kind = next(((p, letter) for p, letter in _PREFIXES if name.startswith(p)), ("", None))
        name = name[len(prefix) :]
        kinds.add("lokr" if m.group("lokr") else kind)
        if (name, role) in keys:  # e.g. `transformer.x.lora_A.weight` beside `x.lora_A.default.weight`
            raise FluxKleinError(
                f"LoRA {what} holds {name}'s {role} {'matrix' if role in ('down', 'up') else 'value'} twice "
                f"({keys[name, role]} and {key}); "
                "the file mixes two namings of one module: keep one"
            )
        keys[name, role] = key
        modules.setdefault(name, {})[role] = value
    return modules, _format_of(kinds, modules)


def _format_of(kinds: set[str | None], modules: dict) -> str:
    """The format of a file from the kinds its keys say (`_PREFIXES`; "lokr" for a LoKr tensor)
    and its module names: the first rule that holds, in this order."""
    rules = (
        ("lokr", "lokr" in kinds),  # any LoKr tensor: the file needs the LoKr reading
        ("diffusers", "diffusers" in kinds),  # then the prefixes; a file that mixes them is named by the first here
        ("bfl", "bfl" in kinds),
        ("peft_bfl", "peft_bfl" in kinds),
        ("kohya", "kohya" in kinds),
        # our names, no prefix
        ("bfl", any(n.startswith(("double_blocks", "single_blocks", "content_mode_blocks")) for n in modules)),
    )
    for name, holds in rules:
        if holds:
            return name
    return "diffusers"  # diffusers' names without a prefix


def _metadata_alpha(metadata: dict | None, what: str):
    """Alpha from the header -> alpha(module, rank), or None (alpha = rank).

    PEFT/diffusers write their adapter config as JSON in `lora_adapter_metadata`; flux-2-swift-mlx
    writes `lora_alpha` and `lora_rank` as plain entries (its scale is lora_alpha / lora_rank).
    """
    metadata = metadata or {}
    raw = metadata.get("lora_adapter_metadata")
    try:
        if raw:
            config = {k.removeprefix("transformer."): v for k, v in json.loads(raw).items()}
            alpha = float(config.get("lora_alpha", 8))  # PEFT's LoraConfig default, as diffusers would build it
            patterns = {str(k).lstrip("^"): float(v) for k, v in (config.get("alpha_pattern") or {}).items()}
            rslora = bool(config.get("use_rslora", False))
            per_rank = None
        elif "lora_alpha" in metadata:
            alpha = float(metadata["lora_alpha"])
            patterns = {}
            rslora = False
            per_rank = float(metadata["lora_rank"]) if "lora_rank" in metadata else None
        else:
            return None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        header = "lora_adapter_metadata" if raw else "lora_alpha / lora_rank"
        raise FluxKleinError(f"LoRA {what} has a damaged {header} header ({e}); re-export it") from None
    for name, v in (("lora_alpha", alpha), ("lora_rank", per_rank or 1.0), *patterns.items()):
        if not math.isfinite(v):
            raise FluxKleinError(f"LoRA {what}: its metadata gives {name} = {v}, not a finite number; re-export it")
    if per_rank is not None and per_rank <= 0:
        raise FluxKleinError(f"LoRA {what}: its metadata gives lora_rank = {per_rank:g}; re-export it")

    def alpha_for(module: str, rank: int) -> float:
        if per_rank is not None:
            return alpha / per_rank * rank  # the writer's scale alpha / lora_rank, whatever the tensor's rank
        a = next((v for p, v in patterns.items() if module == p or module.endswith("." + p)), alpha)
        return a / math.sqrt(rank) * rank if rslora else a  # rsLoRA: scale alpha / sqrt(r)

    return alpha_for


def _scalar(a: mx.array, what: str, key: str) -> float:
    if a.size != 1:
        raise FluxKleinError(f"LoRA {what}: {key}.alpha has {a.size} values, expected one; the file is damaged")
    value = float(a.astype(mx.float32).item())
    if not math.isfinite(value):
        raise FluxKleinError(f"LoRA {what}: {key}.alpha is {value}, not a finite number; the file is damaged")
    return value


def parse_lora(tensors: dict[str, mx.array], metadata: dict | None, params, what: str) -> ParsedLora:
    """Map a LoRA state dict onto our layers; `what` names the file in messages.

    Raises FluxKleinError for foreign models, damaged or incomplete pairs and wrong shapes.
    Module names that match no layer are returned in `unmatched` (the caller decides).
    """
    if not tensors:
        raise FluxKleinError(f"LoRA {what} holds no tensors; download it again")
    modules, fmt = _group(tensors, what)
    names = list(modules)
    unet = next((n for n in names for mk in _UNET_MARKERS if mk in n), None)
    flux1 = next((n for n in names if flux1_marker(n)), None)
    family = lora_family(params)
    for hit, other in ((unet, "an SDXL / Stable Diffusion UNet"), (flux1, "FLUX.1")):
        if hit:
            raise FluxKleinError(
                f"LoRA {what} was made for {other}, not {family.title} (module {hit}); use a LoRA trained for klein"
            )
    made = family_of_names(names)
    if made and made[0] is not family:
        raise FluxKleinError(
            f"LoRA {what} is for {made[0].title} (module {made[1]}), but the model is {family.title} "
            f"({params.describe()}); use a LoRA trained for {family.title}"
        )
    if family.check:
        family.check(names, params, what)
    bare = [n for n, parts in modules.items() if set(parts) == {"alpha"}]
    if bare:
        head = (
            f"{len(bare)} `.alpha` keys and no LoRA weights"
            if len(bare) == len(modules)
            else f"an alpha for {bare[0]} but no weights"
        )
        raise FluxKleinError(f"LoRA {what} is incomplete: it holds {head}; export or download it again")
    table = target_table(params)
    shapes = layer_shapes(params)
    meta_alpha = _metadata_alpha(metadata, what) if fmt == "diffusers" else None
    terms = []
    unmatched = []
    foreign = []
    for name, parts in modules.items():
        target = table.get(name)
        if target is None:
            unmatched.append(name)
            continue
        term = _term(name, parts, target, meta_alpha=meta_alpha, what=what)
        want = (target.rows[1] - target.rows[0], shapes[target.layer][1])
        if term.shape == want:
            terms.append(term)
        else:
            foreign.append((name, term, want))
    if foreign:
        raise FluxKleinError(_foreign_message(foreign, params, what))
    _check_overlaps(terms, what)
    return ParsedLora(format=fmt, terms=terms, unmatched=sorted(unmatched), n_modules=len(modules))


def _check_overlaps(terms: list[Term], what: str) -> None:
    """Refuse two modules of one file that update the same rows of a layer (one module under two namings:
    diffusers' `to_q` beside BFL's `img_attn.qkv`, mflux's `attn.to_out` beside `attn.to_out.0`)."""
    ts = sorted(terms, key=lambda t: (t.layer, t.rows))
    for a, b in zip(ts, ts[1:], strict=False):
        if a.layer == b.layer and b.rows[0] < a.rows[1]:
            raise FluxKleinError(
                f"LoRA {what} updates {a.layer} twice: {a.key} and {b.key} name the same weights (two namings "
                "of one module in one file); keep one of them"
            )


def _term(name: str, parts: dict[str, mx.array], target: Target, *, meta_alpha, what: str) -> Term:
    alpha = _scalar(parts["alpha"], what, name) if "alpha" in parts else None
    for a in parts.values():
        if not mx.issubdtype(a.dtype, mx.floating):
            raise FluxKleinError(f"LoRA {what}: {name} holds {a.dtype} values, not floats; the file is damaged")
    if "down" in parts or "up" in parts:
        if "down" not in parts or "up" not in parts:
            have, miss = ("down", "up") if "down" in parts else ("up", "down")
            raise FluxKleinError(f"LoRA {what} is incomplete: {name} has a {have} matrix but no {miss} matrix")
        down, up = parts["down"], parts["up"]
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
            raise FluxKleinError(
                f"LoRA {what}: {name} has down {tuple(down.shape)} and up {tuple(up.shape)}, which do not form "
                "a rank-r pair (convolution LoRAs do not apply to klein); the file is damaged"
            )
        rank = down.shape[0]
        if rank == 0 or down.size == 0 or up.size == 0:
            raise FluxKleinError(f"LoRA {what}: {name} has rank 0 (empty down/up matrices); the file is damaged")
        if alpha is None:
            alpha = meta_alpha(name, rank) if meta_alpha else float(rank)
        if target.swap and up.shape[0] % 2 == 0:  # [scale ; shift] -> [shift ; scale]
            up = mx.roll(up, up.shape[0] // 2, axis=0)
        return Term(target.layer, target.rows, alpha / rank, down=down, up=up, key=name)
    # LoKr: each factor is stored whole (w1) or as a product (w1_a @ w1_b).
    factors = []
    rank = None
    pairs = {}
    for n in ("w1", "w2"):
        if f"lokr_{n}" in parts:
            factors.append(parts[f"lokr_{n}"])
        elif f"lokr_{n}_a" in parts and f"lokr_{n}_b" in parts:
            a, b = parts[f"lokr_{n}_a"], parts[f"lokr_{n}_b"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
                raise FluxKleinError(f"LoRA {what}: {name}.lokr_{n}_a/_b do not multiply; the file is damaged")
            factors.append(a @ b)
            pairs[n] = (a, b)
            rank = b.shape[0] if n == "w2" or rank is None else rank  # LyCORIS: w2's rank wins
        else:
            raise FluxKleinError(f"LoRA {what} is incomplete: {name} has no lokr_{n} (nor lokr_{n}_a/_b)")
    if "lokr_t1" in parts or "lokr_t2" in parts or any(f.ndim != 2 for f in factors):
        raise FluxKleinError(f"LoRA {what}: {name} is a convolution (Tucker) LoKr, which does not apply to klein")
    if rank == 0 or any(f.size == 0 for f in factors):
        raise FluxKleinError(f"LoRA {what}: {name} has an empty LoKr factor (rank 0); the file is damaged")
    # LyCORIS scales by alpha / rank only when a factor is decomposed; whole factors are used as they are.
    factor = alpha / rank if (alpha is not None and rank) else 1.0
    # LyCORIS' encoding (a low-rank w2 with its alpha) is kept, so that it is written again as it was; a
    # pair without alpha (diffusers' layout: scale 1) is the whole w2 it multiplies to
    w2_a, w2_b = pairs.get("w2", (None, None)) if alpha is not None else (None, None)
    return Term(
        target.layer,
        target.rows,
        factor,
        w1=factors[0],
        w2=factors[1],
        w2_a=w2_a,
        w2_b=w2_b,
        swap=target.swap,
        key=name,
    )


def _foreign_message(foreign: list, params, what: str) -> str:
    """Name the model a LoRA was made for, when its shapes tell; else name the first mismatch."""
    D = params.hidden_size
    hidden = set()
    flux1 = False
    for _name, term, (_rows, cols) in foreign:
        (out, width), layer = term.shape, term.layer
        if cols == D and not layer.endswith(("linear2", "_mlp.2")):  # layers whose input is the hidden state
            hidden.add(width)
        flux1 = flux1 or (layer.endswith("_mlp.0") and out == 4 * width)  # GELU MLP (4D), not SwiGLU (2 x 3D)
        flux1 = flux1 or (layer.endswith("linear1") and out == 7 * width)  # single block: 3D qkv + 4D MLP
        flux1 = flux1 or (layer == "img_in" and width == 64)  # 16 latent channels x 2 x 2
    name, term, want = foreign[0]
    h = next(iter(hidden)) if len(hidden) == 1 else None
    sizes = lora_family(params).hidden_sizes
    if h is not None and h != D and (flux1 or h in sizes):
        family = "FLUX.1" if flux1 else sizes[h]
        return (
            f"LoRA {what} was made for {family} (hidden size {h}), but the model is {params.describe()}; "
            "use a LoRA trained for this model"
        )
    if flux1:
        return (
            f"LoRA {what} was made for FLUX.1 (module {name}), but the model is {params.describe()}; use a klein LoRA"
        )
    made = f"updates a {term.shape[0]}x{term.shape[1]} block"
    if term.w1 is not None:  # LoKr: name the factors, whose Kronecker product is what does not fit
        (a, b), (c, d) = term.w1.shape, term.w2.shape
        made = f"has LoKr factors {a}x{b} and {c}x{d}, whose product is {a * c}x{b * d}"
    r0, r1 = term.rows
    whole = r1 - r0 == layer_shapes(params)[term.layer][0]
    place = f"{term.layer} takes" if whole else f"rows {r0}-{r1} of {term.layer} take"
    return (
        f"LoRA {what}: {name} {made}, but {place} {want[0]}x{want[1]} ({len(foreign)} module(s) do not "
        f"fit); it was made for another model than {params.describe()}, or the file is damaged"
    )
