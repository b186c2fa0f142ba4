"""FLUX.2 [klein] 9B-KV: the reference K/V cache against diffusers' `Flux2KleinKVPipeline`.

The tiny KV snapshot is written by diffusers' own KV pipeline (`tiny_kv_model`). diffusers runs the
transformer with its KV attention processors in `kv_cache_mode="extract"` (references before the
target tokens, attending only to themselves, modulated at timestep 0) and `"cached"`; we run
`FluxKlein.reference_kv` + `forward_with_rope(..., reference_kv=...)`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from refs import rel_err, to_mx, to_np

from flux_klein_mlx.rope import image_ids, text_ids
from flux_klein_mlx.transformer import load_flux_klein
from tiny_kv_model import shared_tiny_kv_snapshot
from tiny_model import LATENT_CHANNELS, QWEN_HIDDEN

C = 4 * LATENT_CHANNELS  # transformer token channels
CTX = 3 * QWEN_HIDDEN
LT = 9  # text tokens: the model must not assume 512


@pytest.fixture(scope="module")
def kv_snapshot(tmp_path_factory):
    return shared_tiny_kv_snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def kv_reference(kv_snapshot):
    """diffusers' KV pipeline (float32), whose constructor installs the KV attention processors."""
    from diffusers import Flux2KleinKVPipeline

    pipe = Flux2KleinKVPipeline.from_pretrained(kv_snapshot, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def kv_transformer(kv_snapshot):
    return load_flux_klein(kv_snapshot / "transformer", dtype=mx.float32)


def _inputs(grid, refs, seed=0):
    from diffusers import Flux2KleinKVPipeline as P

    g = torch.Generator().manual_seed(seed)
    txt = torch.randn(1, LT, CTX, generator=g)
    img = torch.randn(1, grid[0] * grid[1], C, generator=g)
    ref = torch.randn(1, sum(h * w for h, w in refs), C, generator=g)
    ids = dict(
        txt=P._prepare_text_ids(txt),
        img=P._prepare_latent_ids(torch.zeros(1, C, *grid)),
        ref=P._prepare_image_ids([torch.zeros(1, C, h, w) for h, w in refs]),
    )
    return txt, img, ref, ids


@pytest.mark.parametrize("grid, refs", [((3, 5), [(4, 4)]), ((4, 3), [(2, 3), (5, 4)])])
def test_transformer_extract_and_cached_match_diffusers(kv_reference, kv_transformer, grid, refs):
    tr = kv_reference.transformer
    txt, img, ref, ids = _inputs(grid, refs, seed=len(refs))
    n_ref = ref.shape[1]
    t0, t1 = torch.tensor([1.0]), torch.tensor([0.45])
    with torch.no_grad():
        # diffusers' extract step: [refs ; target] tokens, references first
        v0, cache = tr(
            hidden_states=torch.cat([ref, img], 1), encoder_hidden_states=txt, timestep=t0,
            img_ids=torch.cat([ids["ref"], ids["img"]], 1), txt_ids=ids["txt"], return_dict=False,
            kv_cache_mode="extract", num_ref_tokens=n_ref,
        )  # fmt: skip
        v1 = tr(
            hidden_states=img, encoder_hidden_states=txt, timestep=t1, img_ids=ids["img"], txt_ids=ids["txt"],
            return_dict=False, kv_cache=cache, kv_cache_mode="cached",
        )[0]  # fmt: skip

    model = kv_transformer
    our_ref_ids = mx.concatenate([image_ids(h, w, t=10 * (k + 1)) for k, (h, w) in enumerate(refs)], axis=0)
    assert np.array_equal(np.array(our_ref_ids), ids["ref"][0].numpy())
    ours_cache = model.reference_kv(to_mx(ref), our_ref_ids)
    rope = model.compute_rope(text_ids(LT), image_ids(*grid))
    o0 = model.forward_with_rope(to_mx(img), to_mx(txt), to_mx(t0), rope, reference_kv=ours_cache)
    o1 = model.forward_with_rope(to_mx(img), to_mx(txt), to_mx(t1), rope, reference_kv=ours_cache)
    assert v0.shape == v1.shape == (1, img.shape[1], C) == o0.shape
    e0, e1 = rel_err(o0, v0), rel_err(o1, v1)
    assert e0 <= 1e-4 and e1 <= 1e-4, (e0, e1)
    # the cached keys/values, block by block: diffusers (B, Lr, H, hd), ours (B, H, Lr, hd)
    assert ours_cache.num_tokens == n_ref
    assert len(ours_cache.double) == len(cache.double_block_caches) and len(ours_cache.single) == len(
        cache.single_block_caches
    )
    theirs_kv = [(c.k_ref, c.v_ref) for c in cache.double_block_caches + cache.single_block_caches]
    worst = 0.0
    for (k, v), (tk, tv) in zip(ours_cache.double + ours_cache.single, theirs_kv):
        worst = max(worst, rel_err(k.transpose(0, 2, 1, 3), tk), rel_err(v.transpose(0, 2, 1, 3), tv))
    assert worst <= 1e-4, worst
    # the cache really matters: without it the answer is different
    assert rel_err(model.forward_with_rope(to_mx(img), to_mx(txt), to_mx(t1), rope), v1) > 1e-2


def test_transformer_low_memory_reference_pass_is_the_same(kv_transformer):
    txt, img, ref, ids = _inputs((3, 4), [(4, 5)], seed=7)
    model = kv_transformer
    ref_ids = image_ids(4, 5, t=10)
    fast, slow = model.reference_kv(to_mx(ref), ref_ids), model.reference_kv(to_mx(ref), ref_ids, low_memory=True)
    for a, b in zip(fast.arrays(), slow.arrays()):
        assert np.abs(to_np(a) - to_np(b)).max() <= 1e-5
    rope = model.compute_rope(text_ids(LT), image_ids(3, 4))
    args = (to_mx(img), to_mx(txt), mx.array([0.6]), rope)
    a = model.forward_with_rope(*args, reference_kv=fast)
    b = model.forward_with_rope(*args, reference_kv=slow, low_memory=True)
    assert np.abs(to_np(a) - to_np(b)).max() <= 1e-5
    assert fast.nbytes == (2 + 2) * 2 * 20 * 64 * 4  # blocks x (K, V) x tokens x hidden x float32
