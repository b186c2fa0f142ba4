"""Each family's test kit: what a test written once for both families asks of the family it runs on
(issue 45). `KITS[name]` is the kit of the registry's family `name`; conftest.py's `family` fixture runs a
test once per kit. A field belongs here only when both families have it: what truly differs (the KV cache,
the flow map, the canvas reference) stays in the per-family test files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import train_refs
from tiny_flux3 import shared_tiny_flux3_snapshot
from tiny_model import shared_tiny_snapshot

from flux_klein_mlx.models.flux2.config import FluxKleinParams
from flux_klein_mlx.models.flux3.config import Flux3Params

# --- training (tw-train): what tests/train asks of a family ------------------------------------------------------


@dataclass(frozen=True)
class TrainingKit:
    loss: Callable  # diffusers' flow-matching loss (transformer, x0, noise, u, ctxs, conds, grid): train_refs.py
    lora_objective: Callable  # (snapshot, image, caption, lora file) -> diffusers' objective (before, after)
    shift_sigmas: Callable  # (normal draws n, image tokens) -> the reference's `--timesteps shift` noise levels
    lora_slots: int  # the adapters `--targets all` puts on the tiny snapshot
    attention_slots: int  # ... and `--targets attention` (q, k, v and out of every block)
    some_slots: frozenset[str]  # a few of them, named as diffusers names its modules
    reference_blocks: str | None  # the prefix of the blocks only references run through (None: the image's own)
    target_presets: dict  # preset -> the prefix of the slots it names, or those slots themselves (a tuple)
    target_aliases: tuple[str, str]  # our (BFL) name and diffusers' of the same layers
    bad_targets: tuple[str, ...]  # `--targets` values that match nothing of this family
    title: str  # the family's title, which begins every model title of it
    distilled_steps: int  # the distilled model's default steps (a training sample's)
    sibling_repos: dict  # hub repo -> the distilled repo a run from it samples on by default (None: none)
    cli_bad_targets: tuple  # (`train --targets` value, the words of its one-line refusal), on the Base snapshot
    released_params: object  # our transformer parameters of the released Base model at full size
    released_config: dict  # diffusers' transformer config of it, where it is not the class's defaults
    released_count: tuple[int, int]  # bounds on its parameter count


FLUX2_TRAINING = TrainingKit(
    loss=train_refs.flux2_training_loss,
    lora_objective=train_refs.flux2_lora_objective,
    shift_sigmas=train_refs.flux2_shift_sigmas,
    lora_slots=2 * 12 + 2 * 2,  # q, k, v rows of both streams' fused qkv as three adapters each; the single blocks' 2
    attention_slots=2 * 8 + 2 * 2,  # q, k, v, out of both streams; the single blocks' two
    some_slots=frozenset(
        {
            "transformer_blocks.1.attn.to_k",
            "transformer_blocks.0.attn.add_v_proj",
            "single_transformer_blocks.1.attn.to_qkv_mlp_proj",
        }
    ),
    reference_blocks=None,  # FLUX.2's references follow the target in its own stream
    target_presets={
        "double": "transformer_blocks.",
        "single:1-1": ("single_transformer_blocks.1.attn.to_qkv_mlp_proj", "single_transformer_blocks.1.attn.to_out"),
    },
    target_aliases=("img_attn.qkv", "to_q,to_k,to_v"),
    bad_targets=("single:0-12", "nothing_like_this", "double:x"),
    title="FLUX.2 [klein]",
    distilled_steps=4,
    sibling_repos={
        "black-forest-labs/FLUX.2-klein-base-4B": "black-forest-labs/FLUX.2-klein-4B",
        "Black-Forest-Labs/FLUX.2-klein-base-9B": "black-forest-labs/FLUX.2-klein-9B",  # any case, the hub's
        "black-forest-labs/FLUX.2-klein-4B": None,
    },
    cli_bad_targets=(
        ("double:0-9", ("--targets", "2 double blocks")),
        ("to_nowhere", ("--targets to_nowhere", "matches no layer")),
    ),
    released_params=FluxKleinParams(),  # klein-4B (reference-spec 2.1)
    released_config=dict(
        num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False
    ),
    released_count=(3_875_544_576, 3_875_544_576),  # counted from the released model (reference-spec 2.1)
)

FLUX3_TRAINING = TrainingKit(
    loss=train_refs.flux3_training_loss,
    lora_objective=train_refs.flux3_lora_objective,
    shift_sigmas=train_refs.flux3_shift_sigmas,
    lora_slots=(3 * 2 + 2) * 6,  # 3 modes x 2 blocks + 2 single blocks: q, k, v, out, ff in and out
    attention_slots=8 * 4,
    some_slots=frozenset(
        {
            "mode_blocks.image_cond.1.attn.to_q",
            "txt_mode_blocks.0.ff.linear_in",
            "single_transformer_blocks.1.attn.to_out.0",
        }
    ),
    reference_blocks="mode_blocks.image_cond.",  # the references' own stream
    target_presets={
        "image": "mode_blocks.image.",
        "reference:1": "mode_blocks.image_cond.1.",
        "text": "txt_mode_blocks.",
        "single:0-0": "single_transformer_blocks.0.",
    },
    target_aliases=("q_proj", "to_q"),
    bad_targets=("double", "single:0-5", "ref_time_in.in_layer", "target_timestep_embedder.linear_1"),
    title="FLUX 3 Image Klein",
    distilled_steps=16,
    sibling_repos={
        "black-forest-labs/flux-3-image-klein-base": "black-forest-labs/flux-3-image-klein",
        "black-forest-labs/flux-3-image-klein": None,
    },
    cli_bad_targets=(
        ("double", ("--targets double matches no layer of FLUX 3 Image Klein",)),  # FLUX.2's preset
        ("ref_time_in.in_layer", ("--targets ref_time_in.in_layer matches no layer",)),  # the distilled model's
        ("reference", ("--targets reference adapts only the reference blocks",)),  # without --control
    ),
    released_params=Flux3Params(),
    released_config={},  # diffusers' defaults are FLUX 3 Image Klein Base's
    released_count=(5_500_000_000, 5_600_000_000),
)

# --- end of training (tw-train) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyKit:
    name: str  # the key of flux_klein_mlx.family.FAMILIES
    snapshot: Callable[..., Path]  # (tmp_path_factory, *, distilled) -> the tiny snapshot, built once a session
    transformer_class: str  # diffusers' transformer class, by name (diffusers imports late: it is slow)
    training: TrainingKit  # tw-train: what tests/train asks (above)

    def reference_transformer_class(self):
        import diffusers

        return getattr(diffusers, self.transformer_class)


KITS = {
    "flux2": FamilyKit("flux2", shared_tiny_snapshot, "Flux2Transformer2DModel", training=FLUX2_TRAINING),
    "flux3": FamilyKit("flux3", shared_tiny_flux3_snapshot, "Flux3Transformer2DModel", training=FLUX3_TRAINING),
}
