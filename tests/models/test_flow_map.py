"""FLUX 3 Image Klein's transformer where FLUX.2 has no twin (the parity both families share is
test_transformer.py): the reference stream's effect on the image, the flow map's target time and the sigma
rounded in the model's dtype, the calls the flow map and Base each refuse, and the one name table serving
diffusers' and PEFT's module paths both ways. The tiny references and inputs: tests/support/tiny_transformers.py."""

from __future__ import annotations

import mlx.core as mx
import pytest
import torch
from refs import rel_err, to_mx
from tiny_transformers import LT, TRANSFORMERS

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.flux3.config import Flux3Params
from flux_klein_mlx.models.flux3.transformer import (
    Flux3,
    flux3_diffusers_name,
    flux3_name,
    infer_flux3_params,
    linear_shapes,
)

TWIN = TRANSFORMERS["flux3"]


@pytest.fixture(scope="module", params=TWIN.variants)
def pair(request):
    """(diffusers reference, our model loaded strictly from its state dict)."""
    reference = TWIN.reference(request.param)
    return reference, TWIN.load(reference)


def test_references_change_the_output_as_in_diffusers(pair):
    """The reference stream is not a no-op: its effect on the image is the reference's effect."""
    reference, ours = pair
    with_ref = TWIN.inputs(reference, 1, (3, 4), [(2, 2)], seed=7)
    without = with_ref._replace(ref=None, ref_ids=None, refs=[])
    (m1, t1), (m0, t0) = (
        (TWIN.ours(ours, x, [0.6], [0.4]), TWIN.theirs(reference, x, [0.6], [0.4])) for x in (with_ref, without)
    )
    assert float((t1 - t0).abs().max()) > 1e-3
    assert rel_err(m1 - m0, t1 - t0) <= 1e-4


def test_timestep_is_rounded_in_the_model_dtype():
    """diffusers embeds bf16(sigma) x 1000 rounded to bf16 (0.7 -> 700), not float32 700.0 or 699.2."""
    reference = TWIN.reference("g64-fm0").to(torch.bfloat16)
    ours = TWIN.load(reference, dtype=mx.bfloat16)
    t = torch.tensor([0.7, 0.123])
    with torch.no_grad():
        theirs = reference.timestep_embedder(reference.time_proj(t.to(torch.bfloat16) * 1000).to(torch.bfloat16))
    vec, zero = ours.time_vectors(to_mx(t), None, 2)
    assert rel_err(vec, theirs) <= 1e-2, rel_err(vec, theirs)
    with torch.no_grad():
        theirs0 = reference.timestep_embedder(reference.time_proj(torch.zeros(1)).to(torch.bfloat16))
    assert rel_err(zero[:1], theirs0) <= 1e-2


def test_bad_inputs_say_what_is_wrong():
    small = TWIN.CONFIGS["small"]
    base, fm = Flux3(Flux3Params.from_dict(dict(small))), Flux3(Flux3Params.from_dict(dict(small, flow_map=True)))
    x = TWIN.inputs(TWIN.reference("small-fm0"), 1, (2, 2), [(2, 2)], seed=0)
    img, txt, img_ids, txt_ids, ref, ref_ids = map(to_mx, x[:6])
    t = mx.array([0.5])
    with pytest.raises(ValueError, match="required by, and only by"):
        base(img, txt, t, img_ids, txt_ids, target_timesteps=t)
    with pytest.raises(ValueError, match="required by, and only by"):
        fm(img, txt, t, img_ids, txt_ids)
    with pytest.raises(ValueError, match="ref and ref_ids go together"):
        base(img, txt, t, img_ids, txt_ids, ref=ref)
    rope = base.compute_rope(txt_ids, img_ids)
    with pytest.raises(ValueError, match="go together"):
        base.forward_with_rope(img, txt, t, rope, ref=ref)
    with pytest.raises(ValueError, match="for Base"):
        fm.early_text(txt, rope)
    with pytest.raises(ValueError, match="for Base"):
        fm.forward_with_rope(img, None, t, rope, txt_early=mx.zeros((1, LT, 32)), target_timesteps=t)
    with pytest.raises(ValueError, match="RoPE tables cover"):
        base.forward_with_rope(img, txt[:, :3], t, rope)
    with pytest.raises(FluxKleinError, match="not a FLUX 3 Image Klein transformer"):
        infer_flux3_params({"img_in.weight": mx.zeros((4, 4))})
    with pytest.raises(FluxKleinError, match="RoPE axes"):
        Flux3Params(hidden_size=64, num_heads=2, axes_dim=(8, 8, 8, 4))


def test_name_table_reads_lora_module_paths(pair):
    """The one name table serves module paths too (what a diffusers/PEFT LoRA names), both ways."""
    reference, _ = pair
    for key in reference.state_dict():
        assert flux3_diffusers_name(flux3_name(key)) == key
    ours = linear_shapes(Flux3Params.from_dict(dict(reference.config)))
    for path, module in reference.named_modules():
        assert flux3_diffusers_name(flux3_name(path)) == path
        if isinstance(module, torch.nn.Linear):  # every diffusers Linear is one of ours, same (out, in)
            assert ours[flux3_name(path)] == tuple(module.weight.shape), path
    assert flux3_name("mode_blocks.image_cond.3.attn.to_out.0") == "content_mode_blocks.image_cond.3.attn_out"
    assert flux3_name("single_transformer_blocks.27.ff.linear_in") == "single_blocks.27.mlp_in"
    assert flux3_name("txt_mode_blocks.0.attn.norm_k.weight") == "txt_mode_blocks.0.norm.key_norm.scale"
    assert flux3_name("early_stream_modulations.txt.linear") == "early_stream_modulations.txt.lin"
    assert flux3_name("content_mode_blocks.image.0.q_proj") == "content_mode_blocks.image.0.q_proj"
