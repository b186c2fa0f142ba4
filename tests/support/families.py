"""Each family's test kit: what a test written once for both families asks of the family it runs on
(issue 45). `KITS[name]` is the kit of the registry's family `name`; conftest.py's `family` fixture runs a
test once per kit. A field belongs here only when both families have it: what truly differs (the KV cache,
the flow map, the canvas reference) stays in the per-family test files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import train_refs
from flux3_refs import flux3_reference
from refs import flux2_reference
from text_encoders import TEXTS
from tiny_flux3 import shared_tiny_flux3_snapshot, write_bfl_flux3_file
from tiny_loras import LORAS
from tiny_model import shared_tiny_snapshot, write_bfl_file
from tiny_transformers import TRANSFORMERS

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
    # --- tw-models (tests/models, tests/lora) ---
    text: object  # text_encoders.Qwen3Texts / Qwen3VLTexts: the tiny text encoder, its judge, prompts, tolerance
    transformer: object  # tiny_transformers.Flux2Transformers / Flux3Transformers: references, inputs, BFL names
    lora: object  # tiny_loras.Flux2Loras / Flux3Loras: BFL names of a peft adapter, diffusers' LoRA loader
    training: TrainingKit  # tw-train: what tests/train asks (above)
    # --- tw-doors: the doors' tests (test_pipeline, serve, benchmark, the command line) ---
    # diffusers' image from injected latents: (snapshot, *, prompt, latents, steps, images=None, guidance=None,
    # negative_prompt=None, width=None, height=None) -> (H, W, 3) float32 in [0, 1], the pipeline loaded once
    reference_image: Callable[..., object] = None
    title: str = ""  # the tiny distilled snapshot's model name (info.name); Base's is it + " Base"
    defaults: tuple = ()  # (steps, guidance) of the distilled model, then of Base (guidance None: no CFG)
    windows: tuple[int, int] = ()  # the text window (tokens) of a prompt of over 80 tokens, of a short one
    custom_variant: str = ""  # what `info.variant` says of the tiny snapshots (no released row's size)
    text_layers: int = 0  # the text encoder's layers a prompt runs through (its deepest tap)
    base_runs_once_per_image: bool = False  # Base runs the text and references' modes once per image, not per step
    keeps_reference_size: bool = False  # one reference runs on its canvas and the image is cropped back to it
    has_upsampler: bool = False  # the family's prompt upsampler (`upsample`, the page's checkbox)
    repo_id: str = ""  # the released distilled model's hub id (a test lays the tiny snapshot out under it)
    write_bfl: Callable[..., Path] = None  # (snapshot, path, *, prefix="") -> the transformer as a BFL file
    # bits -> (numpy statistic of |quantized - float32| image, its bound): 3 steps at 64x64 (test_pipeline)
    quantized_bounds: dict = None
    bfloat16_max: float = 0.0  # the most a bfloat16 image may differ from float32's (4 steps, 64x64, seed 0)

    def reference_transformer_class(self):
        import diffusers

        return getattr(diffusers, self.transformer_class)


def models_kit(name: str) -> dict:
    """The tw-models fields (tests/models, tests/lora) of family `name`'s kit."""
    return dict(text=TEXTS[name], transformer=TRANSFORMERS[name], lora=LORAS[name])


KITS = {
    "flux2": FamilyKit(
        "flux2",
        shared_tiny_snapshot,
        "Flux2Transformer2DModel",
        **models_kit("flux2"),
        training=FLUX2_TRAINING,
        # tw-doors
        reference_image=flux2_reference,
        title="FLUX.2 [klein] (custom size)",
        defaults=((4, None), (50, 4.0)),
        windows=(512, 512),  # every prompt fills the whole window
        custom_variant="other",  # neither klein-4b nor klein-9b
        text_layers=27,
        base_runs_once_per_image=False,
        keeps_reference_size=False,  # the reference is cropped to the 16-px grid, the image has its size
        has_upsampler=False,
        repo_id="black-forest-labs/FLUX.2-klein-4B",
        write_bfl=write_bfl_file,
        # measured at seeds 6-8: max 0.0067-0.0098 at 8 bits, 0.18-0.24 at 4 (means 0.0009-0.0010, 0.017-0.019)
        quantized_bounds={8: ("max", 0.05), 4: ("max", 0.5)},
        bfloat16_max=0.1,
    ),
    "flux3": FamilyKit(
        "flux3",
        shared_tiny_flux3_snapshot,
        "Flux3Transformer2DModel",
        **models_kit("flux3"),
        training=FLUX3_TRAINING,
        # tw-doors
        reference_image=flux3_reference,
        title="FLUX 3 Image Klein",
        defaults=((16, None), (50, 3.5)),
        windows=(160, 80),  # the prompt's length rounded up to 80 tokens
        custom_variant="flux3",  # FLUX 3's params name the family alone
        text_layers=32,
        base_runs_once_per_image=True,
        keeps_reference_size=True,
        has_upsampler=True,
        repo_id="black-forest-labs/flux-3-image-klein",
        write_bfl=write_bfl_flux3_file,
        # group 64: the tiny hidden size 64 is one group per row, the worst case (the 5.5B model has 48 per row).
        # Measured at seeds 6-8: mean 0.0012-0.0013 at 8 bits, 0.021-0.024 at 4 (max 0.26); twice the worst mean.
        quantized_bounds={8: ("mean", 0.005), 4: ("mean", 0.05)},
        bfloat16_max=0.3,  # measured 0.21 on the tiny FLUX 3 (its mean against diffusers stays under 0.05)
    ),
}
