"""The module names a LoRA may use on each model family's transformer (`LORA_FAMILIES`), and which family a
file's names are for. The one home of "which diffusers / BFL / kohya name is which of our layers (and rows)",
read by the readers (`formats.parse_lora`), the writers (`layouts`) and the trainer (`train/step/adapters`).

FLUX.2 [klein]: BFL fuses q, k, v (and, in a single block, the MLP's input) into one matrix, diffusers splits
them, so a diffusers name may cover a row range of one of our layers. FLUX 3 Image Klein: every diffusers name
is one whole layer of ours (`models/flux3/transformer`'s tables, read both ways). In both, the final
modulation's rows are [scale ; shift] in diffusers, [shift ; scale] in ours (`Target.swap`). kohya and LyCORIS
write the same names with underscores. The family is found from the type of the model's hyper-parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import FluxKleinError
from ..family import FLUX2, FLUX3
from ..models.flux2 import transformer as flux2
from ..models.flux2.config import HIDDEN_SIZES
from ..models.flux2.transformer import DIFFUSERS_DOUBLE, DIFFUSERS_SINGLE, DIFFUSERS_TOP, QKV
from ..models.flux3 import transformer as flux3
from ..models.flux3.config import Flux3Params

# Other trainers' names for diffusers modules: mflux (its own module paths) and flux-2-swift-mlx.
_ALIASES_TOP = {"time_guidance_embed.linear_1": "time_guidance_embed.timestep_embedder.linear_1",
               "time_guidance_embed.linear_2": "time_guidance_embed.timestep_embedder.linear_2"}  # fmt: skip
_ALIASES_DOUBLE = {"attn.to_out": "attn.to_out.0", "ff.activation.proj": "ff.linear_in",
                  "ff_context.activation.proj": "ff_context.linear_in"}  # fmt: skip
_ALIASES_SINGLE = {"attn.to_qkv_mlp": "attn.to_qkv_mlp_proj"}
# diffusers' own fused projections (after `fuse_qkv_projections`, as its LoKr loader uses), ours
DIFFUSERS_FUSED = {"attn.to_qkv": "img_attn.qkv", "attn.to_added_qkv": "txt_attn.qkv"}


@dataclass(frozen=True)
class Target:
    """Where a named module lands in our model: a layer, a row range of its output, and the row order."""

    layer: str  # our module path, e.g. "double_blocks.0.img_attn.qkv"
    rows: tuple[int, int]  # [start, stop) of the layer's output rows
    swap: bool = False  # rows given as [scale ; shift] (diffusers' norm_out), ours are [shift ; scale]


def _flux2_modules(params, blocks_only: bool) -> list[str]:
    """FLUX.2: the top modules, then each double block's (q, k, v of both streams, then the rest), then
    each single block's."""
    names = [] if blocks_only else [*DIFFUSERS_TOP, "norm_out.linear"]
    for i in range(params.depth):
        names += [f"transformer_blocks.{i}.{p}" for parts in QKV.values() for p in parts]
        names += [f"transformer_blocks.{i}.{m}" for m in DIFFUSERS_DOUBLE if not m.endswith(".weight")]
    for j in range(params.depth_single):
        names += [f"single_transformer_blocks.{j}.{m}" for m in DIFFUSERS_SINGLE if not m.endswith(".weight")]
    return names


def _flux2_table(params) -> dict[str, Target]:
    """FLUX.2 [klein]: our names, diffusers' (split q/k/v inside our fused layers), mflux's and swift's."""
    D, M = params.hidden_size, params.mlp_hidden
    table = {path: Target(path, (0, out)) for path, (out, _) in flux2.linear_shapes(params).items()}
    table["norm_out.linear"] = Target("final_layer.adaLN_modulation.1", (0, 2 * D), swap=True)
    for theirs, ours, n, names, aliases in (
        ("", "", 1, DIFFUSERS_TOP, _ALIASES_TOP),
        (
            "transformer_blocks.{}.",
            "double_blocks.{}.",
            params.depth,
            {**DIFFUSERS_DOUBLE, **DIFFUSERS_FUSED},
            _ALIASES_DOUBLE,
        ),
        ("single_transformer_blocks.{}.", "single_blocks.{}.", params.depth_single, DIFFUSERS_SINGLE, _ALIASES_SINGLE),
    ):
        names = {k: v for k, v in names.items() if not k.endswith(".weight")}  # the norms are not Linears
        names.update({alias: names[name] for alias, name in aliases.items()})
        for i in range(n):  # whole layers under another name
            table.update({theirs.format(i) + k: table[ours.format(i) + v] for k, v in names.items()})
    for i in range(params.depth):
        for ours, parts in QKV.items():
            for n, part in enumerate(parts):  # diffusers' q, k, v are row blocks of our fused qkv
                table[f"transformer_blocks.{i}.{part}"] = Target(f"double_blocks.{i}.{ours}", (n * D, (n + 1) * D))
    for j in range(params.depth_single):
        # Separate q/k/v/MLP-in names for the fused linear1, rows [q | k | v | a | b]
        for n, part in enumerate(("to_q", "to_k", "to_v")):
            table[f"single_transformer_blocks.{j}.attn.{part}"] = Target(
                f"single_blocks.{j}.linear1", (n * D, (n + 1) * D)
            )
        table[f"single_transformer_blocks.{j}.proj_mlp"] = Target(f"single_blocks.{j}.linear1", (3 * D, 3 * D + 2 * M))
    table.update({name.replace(".", "_"): t for name, t in list(table.items())})
    return table


def _flux3_modules(params, blocks_only: bool) -> list[str]:
    """FLUX 3: diffusers' name of each of our Linears (one module per layer), in our model order."""
    layers = flux3.linear_shapes(params)
    # a block: `single_blocks.N.`, `txt_mode_blocks.N.` or a content mode's `content_mode_blocks.<mode>.N.`
    block = re.compile(r"blocks\.(?:\w+\.)?\d+\.")
    return [flux3.flux3_diffusers_name(p) for p in layers if not blocks_only or block.search(p)]


def _flux3_table(params) -> dict[str, Target]:
    """FLUX 3 Image Klein: each Linear under our (BFL) name and diffusers', dotted and underscored; every name
    is a whole layer (no fused q/k/v); diffusers' norm_out rows are [scale ; shift]."""
    table = {}
    for path, (out, _) in flux3.linear_shapes(params).items():
        theirs = flux3.flux3_diffusers_name(path)
        table[path] = Target(path, (0, out))
        table[theirs] = Target(path, (0, out), swap=theirs == "norm_out.linear")
    table.update({name.replace(".", "_"): t for name, t in list(table.items())})
    return table


def _flux3_check(names: list[str], params, what: str) -> None:
    """A LoRA of the target-time embedder (`ref_time_in`, diffusers' `target_timestep_embedder`) on the Base."""
    hit = next((n for n in names if re.match(r"(ref_time_in|target_timestep_embedder)[._]", n)), None)
    if hit and not params.flow_map:
        raise FluxKleinError(
            f"LoRA {what} adapts {hit} (ref_time_in, the target-time embedder only the distilled FLUX 3 Image Klein "
            f"has): it was trained on the distilled model, but the model is the Base ({params.describe()}); use it "
            "with the distilled model"
        )


@dataclass(frozen=True)
class LoraFamily:
    """What lora/ knows of one model family: its title, its transformer's names and shapes, its markers."""

    title: str  # family/'s Family.title
    params_type: type  # the transformer's hyper-parameters
    table: Callable  # params -> {module name a LoRA may use: Target}
    modules: Callable  # (params, blocks_only) -> diffusers' Linear module names, in model order
    shapes: Callable  # params -> {our layer: (out, in)}
    markers: re.Pattern  # module names (dotted or underscored, any prefix) only this family has
    hidden_sizes: dict[int, str]  # the released models by hidden size, for "made for ..." messages
    check: Callable | None = None  # (names, params, what) -> None: a family's own refusal


_EDGE = r"(?:^|(?<=[._]))"  # a name segment starts here (after a prefix, a dot or kohya's underscore)
FLUX2_LORA = LoraFamily(
    title=FLUX2.title,
    params_type=FLUX2.params_type,
    table=_flux2_table,
    modules=_flux2_modules,
    shapes=FLUX2.linear_shapes,
    markers=re.compile(
        _EDGE + r"(?:(?:double_blocks|img_attn|txt_attn|img_mlp|txt_mlp|linear[12]|to_qkv_mlp(?:_proj)?|ff_context"
        r"|time_guidance_embed|double_stream_modulation_\w+|single_stream_modulation|add_[qkv]_proj|to_add_out"
        r"|img_in|x_embedder|final_layer[._](?:linear|adaLN))(?:[._]|$)|(?<!single_)(?<!single\.)transformer_blocks[._])"
    ),
    hidden_sizes=HIDDEN_SIZES,
)
FLUX3_LORA = LoraFamily(
    title=FLUX3.title,
    params_type=FLUX3.params_type,
    table=_flux3_table,
    modules=_flux3_modules,
    shapes=FLUX3.linear_shapes,
    markers=re.compile(
        _EDGE + r"(?:content_mode_blocks|mode_blocks|early_stream_modulations|single_stream_modulations|emb_in"
        r"|x_embedders|ref_time_in|target_timestep_embedder|(?<!add_)[qkv]_proj|attn_out|mlp_in|mlp_out"
        r"|final_layer[._]image|single_transformer_blocks[._]\d+[._]ff)(?:[._]|$)"
    ),
    hidden_sizes={Flux3Params().hidden_size: FLUX3.title},
    check=_flux3_check,
)
LORA_FAMILIES = (FLUX2_LORA, FLUX3_LORA)


def lora_family(params) -> LoraFamily:
    """The family of a transformer's hyper-parameters (`FluxKleinParams`, `Flux3Params`)."""
    return next(f for f in LORA_FAMILIES if isinstance(params, f.params_type))


def family_of_names(names) -> tuple[LoraFamily, str] | None:
    """The family a LoRA's module names (or keys) are for, and a name that says it; None when no name, or
    names of both, tell (names both have: `txt_in`, `time_in`, `single_blocks.N`, `proj_out`, ...)."""
    hits = [(f, next((n for n in names if f.markers.search(n)), None)) for f in LORA_FAMILIES]
    hits = [(f, n) for f, n in hits if n is not None]
    return hits[0] if len(hits) == 1 else None


def layer_shapes(params) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear of the transformer with `params` (any family), by our module path."""
    return lora_family(params).shapes(params)


def diffusers_modules(params, *, blocks_only: bool = False) -> list[str]:
    """The diffusers modules of a transformer that are Linears, in model order. The one list of "a block's
    diffusers layers" (the trainer's slots, the diffusers layout's units)."""
    return lora_family(params).modules(params, blocks_only)


def target_table(params) -> dict[str, Target]:
    """Every module name a LoRA for this transformer may use (ours, diffusers', dotted and underscored) -> its
    Target, from the family's own name tables."""
    return lora_family(params).table(params)
