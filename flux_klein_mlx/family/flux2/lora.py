"""FLUX.2 [klein]'s LoRA names: which diffusers / BFL / kohya / mflux name is which of our layers (and rows),
and the module names only its LoRA files carry (lora/names asks them through `FLUX2.lora`).

BFL fuses q, k, v (and, in a single block, the MLP's input) into one matrix, diffusers splits them, so a
diffusers name may cover a row range of one of our layers; the final modulation's rows are [scale ; shift] in
diffusers, [shift ; scale] in ours (`Target.swap`). kohya and LyCORIS write the same names with underscores.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from ...models.flux2 import transformer as flux2
from ...models.flux2.config import FluxKleinParams
from ...models.flux2.transformer import DIFFUSERS_DOUBLE, DIFFUSERS_SINGLE, DIFFUSERS_TOP, QKV
from ..base import EDGE, SINGLE_BLOCK, Target

# Other trainers' names for diffusers modules: mflux (its own module paths) and flux-2-swift-mlx.
_ALIASES_TOP = {"time_guidance_embed.linear_1": "time_guidance_embed.timestep_embedder.linear_1",
               "time_guidance_embed.linear_2": "time_guidance_embed.timestep_embedder.linear_2"}  # fmt: skip
_ALIASES_DOUBLE = {"attn.to_out": "attn.to_out.0", "ff.activation.proj": "ff.linear_in",
                  "ff_context.activation.proj": "ff_context.linear_in"}  # fmt: skip
_ALIASES_SINGLE = {"attn.to_qkv_mlp": "attn.to_qkv_mlp_proj"}
# diffusers' own fused projections (after `fuse_qkv_projections`, as its LoKr loader uses), ours
DIFFUSERS_FUSED = {"attn.to_qkv": "img_attn.qkv", "attn.to_added_qkv": "txt_attn.qkv"}


_DOUBLE = re.compile(r"(?<!single_)(?:double_blocks|transformer_blocks)[._](\d+)[._]")
# module-name endings whose input width is a model setting, not the hidden size
_WIDTHS = {"in_channels": ("img_in", "x_embedder"), "context_in_dim": ("txt_in", "context_embedder"),
           "time_channels": ("time_in.in_layer", "time_in_in_layer", "timestep_embedder.linear_1",
                             "timestep_embedder_linear_1", "time_guidance_embed.linear_1")}  # fmt: skip
_RELEASED = {3072: FluxKleinParams.klein_4b, 4096: FluxKleinParams.klein_9b}


def flux2_modules(params, blocks_only: bool) -> list[str]:
    """FLUX.2: the top modules, then each double block's (q, k, v of both streams, then the rest), then
    each single block's."""
    names = [] if blocks_only else [*DIFFUSERS_TOP, "norm_out.linear"]
    for i in range(params.depth):
        names += [f"transformer_blocks.{i}.{p}" for parts in QKV.values() for p in parts]
        names += [f"transformer_blocks.{i}.{m}" for m in DIFFUSERS_DOUBLE if not m.endswith(".weight")]
    for j in range(params.depth_single):
        names += [f"single_transformer_blocks.{j}.{m}" for m in DIFFUSERS_SINGLE if not m.endswith(".weight")]
    return names


def flux2_table(params) -> dict[str, Target]:
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


def guess_params(keys, widths: dict[str, int]) -> list[FluxKleinParams]:
    """The transformers a LoRA may be for, most likely first: one per candidate hidden size (the most
    common input width first), klein-4B/9B's own settings for their hidden sizes. `widths`: a LoRA file's
    module -> input width of its down matrix (lora/convert reads them)."""
    blocks = [
        max((int(m.group(1)) + 1 for k in keys if (m := rx.search(k))), default=0) for rx in (_DOUBLE, SINGLE_BLOCK)
    ]
    extra = {}
    for field, ends in _WIDTHS.items():
        hit = next((w for k, w in widths.items() if k.endswith(ends)), None)
        if hit is not None:
            extra[field] = hit
    candidates = []
    for hidden, _ in collections.Counter(widths.values()).most_common(4):
        if (
            hidden in _RELEASED
            and blocks[0] <= _RELEASED[hidden]().depth
            and blocks[1] <= _RELEASED[hidden]().depth_single
        ):
            candidates.append(dataclasses.replace(_RELEASED[hidden](), **extra))
        elif hidden % 2 == 0:  # any width: one head, one RoPE axis (neither changes a weight's shape)
            candidates.append(
                FluxKleinParams(
                    hidden_size=hidden,
                    num_heads=1,
                    axes_dim=(hidden,),
                    depth=blocks[0],
                    depth_single=blocks[1],
                    **extra,
                )
            )
    return candidates or [FluxKleinParams.klein_4b()]


# Module names (dotted or underscored, any prefix) only FLUX.2 [klein] has: they tell its model files and its LoRA
# files from a later family's (family.family_of_names, lora/names.family_of_names).
FLUX2_MARKERS = re.compile(
    EDGE + r"(?:(?:double_blocks|img_attn|txt_attn|img_mlp|txt_mlp|linear[12]|to_qkv_mlp(?:_proj)?|ff_context"
    r"|time_guidance_embed|double_stream_modulation_\w+|single_stream_modulation|add_[qkv]_proj|to_add_out"
    r"|img_in|x_embedder|final_layer[._](?:linear|adaLN))(?:[._]|$)|(?<!single_)(?<!single\.)transformer_blocks[._])"
)
