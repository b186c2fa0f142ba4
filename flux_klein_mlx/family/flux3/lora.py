"""FLUX 3 Image Klein's LoRA names: every diffusers name is one whole layer of ours (`models/flux3/transformer`'s
tables, read both ways), dotted or underscored; and the module names only its LoRA files carry.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from ...errors import FluxKleinError
from ...models.flux3 import transformer as flux3
from ...models.flux3.config import Flux3Params
from ..base import EDGE, SINGLE_BLOCK, Target

# FLUX 3 Image Klein: its stacks (diffusers' and ours) and the widths that are settings (BFL / diffusers names)
_MODE = re.compile(r"(?:mode_blocks[._](?:image|image_cond)|txt_mode_blocks)[._](\d+)[._]")
_WIDTHS3 = {"in_channels": ("emb_in.image", "emb_in_image", "x_embedders.image", "x_embedders_image"),
            "cond_in_channels": ("emb_in.image_cond", "emb_in_image_cond", "x_embedders.image_cond",
                                 "x_embedders_image_cond"),
            "context_in_dim": ("txt_in", "context_embedder"),
            "time_channels": ("time_in.in_layer", "time_in_in_layer", "timestep_embedder.linear_1",
                              "timestep_embedder_linear_1")}  # fmt: skip


def flux3_modules(params, blocks_only: bool) -> list[str]:
    """FLUX 3: diffusers' name of each of our Linears (one module per layer), in our model order."""
    layers = flux3.linear_shapes(params)
    # a block: `single_blocks.N.`, `txt_mode_blocks.N.` or a content mode's `content_mode_blocks.<mode>.N.`
    block = re.compile(r"blocks\.(?:\w+\.)?\d+\.")
    return [flux3.flux3_diffusers_name(p) for p in layers if not blocks_only or block.search(p)]


def flux3_table(params) -> dict[str, Target]:
    """FLUX 3 Image Klein: each Linear under our (BFL) name and diffusers', dotted and underscored; every name
    is a whole layer (no fused q/k/v); diffusers' norm_out rows are [scale ; shift]."""
    table = {}
    for path, (out, _) in flux3.linear_shapes(params).items():
        theirs = flux3.flux3_diffusers_name(path)
        table[path] = Target(path, (0, out))
        table[theirs] = Target(path, (0, out), swap=theirs == "norm_out.linear")
    table.update({name.replace(".", "_"): t for name, t in list(table.items())})
    return table


def flux3_check(names: list[str], params, what: str) -> None:
    """A LoRA of the target-time embedder (`ref_time_in`, diffusers' `target_timestep_embedder`) on the Base."""
    hit = next((n for n in names if re.match(r"(ref_time_in|target_timestep_embedder)[._]", n)), None)
    if hit and not params.flow_map:
        raise FluxKleinError(
            f"LoRA {what} adapts {hit} (ref_time_in, the target-time embedder only the distilled FLUX 3 Image Klein "
            f"has): it was trained on the distilled model, but the model is the Base ({params.describe()}); use it "
            "with the distilled model"
        )


def guess_params(keys, widths: dict[str, int]) -> list[Flux3Params]:
    """The FLUX 3 Image Klein transformer a LoRA may be for: the released one for its hidden size (the distilled
    one when the file adapts the target-time embedder), else one of the file's own widths and block counts."""
    extra = {f: w for f, ends in _WIDTHS3.items() if (w := next((w for k, w in widths.items() if k.endswith(ends)), 0))}
    flow_map = any(re.search(r"(?:ref_time_in|target_timestep_embedder)[._]", k) for k in keys)
    mlp = next((w for k, w in widths.items() if k.endswith(("mlp_out", "ff.linear_out", "ff_linear_out"))), None)
    depth = max((int(m.group(1)) + 1 for k in keys if (m := _MODE.search(k))), default=0)
    single = max((int(m.group(1)) + 1 for k in keys if (m := SINGLE_BLOCK.search(k))), default=0)
    candidates = []
    for hidden, _ in collections.Counter(widths.values()).most_common(4):
        released = Flux3Params(flow_map=flow_map)
        if hidden == released.hidden_size and depth <= released.depth and single <= released.depth_single:
            candidates.append(dataclasses.replace(released, **extra))
        elif hidden % 2 == 0:  # one head, one RoPE axis (neither changes a weight's shape)
            ratio = {"mlp_ratio": mlp / hidden} if mlp else {}
            candidates.append(
                Flux3Params(
                    hidden_size=hidden,
                    num_heads=1,
                    axes_dim=(hidden,),
                    depth=depth,
                    depth_single=single,
                    flow_map=flow_map,
                    **ratio,
                    **extra,
                )
            )
    return candidates or [Flux3Params(flow_map=flow_map)]


# Module names only FLUX 3 has: they tell its model files (its hidden size is klein-4B's, so never by shapes) and its
# LoRA files from FLUX.2's. diffusers' classes are Flux3*, and BFL's file has per-mode blocks and, distilled, a second
# timestep embedder (the keys diffusers' single-file loader tells it by).
FLUX3_MARKERS = re.compile(
    EDGE + r"(?:content_mode_blocks|mode_blocks|early_stream_modulations|single_stream_modulations|emb_in"
    r"|x_embedders|ref_time_in|target_timestep_embedder|(?<!add_)[qkv]_proj|attn_out|mlp_in|mlp_out"
    r"|final_layer[._]image|single_transformer_blocks[._]\d+[._]ff)(?:[._]|$)"
)
