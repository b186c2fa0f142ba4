"""Softmax attention within the backend's limits: the one home of how the models call
`mx.fast.scaled_dot_product_attention` on long sequences (the transformer's joint text + image
sequence; the cached reference keys of the KV variant).

Shapes: B batch, H heads, L queries, Lk keys, hd head dim.
"""

from __future__ import annotations

import mlx.core as mx

from .kv_cache import KV

# Most score elements (B·H·queries·Lk) per attention call. MLX's CPU sdpa builds the (B, H, Lq, Lk) scores;
# its matmul by v takes a head's Lq·Lk as int32 (backend/cpu/matmul.cpp). Measured, MLX 0.32.4 CPU, hd 32,
# fp32 and bf16, one head: Lq·Lk = 2^31 - 2^16 right; 2^31 all rows wrong, no error; 2^32 SIGFPE; 66048^2
# (4096^2 px + 512 text tokens) SIGSEGV; 2 heads x 2^30 right. Bounding the call bounds each head and the
# memory (8 GiB fp32). Metal's fused kernel (hd 128, inference) builds no scores: the split only adds calls.
SCORE_LIMIT = 2**31 - 1


def attend(q: mx.array, k: mx.array, v: mx.array, ref_kv: KV | None = None) -> mx.array:
    """Full softmax attention of q (B, H, L, hd) over k, v (B, H, Lk, hd), heads merged -> (B, L, H·hd).

    `ref_kv`: cached reference keys/values (B, H, Lr, hd), already rotated, that every query also
    attends to (the KV variant's cached steps); key order does not change softmax attention.
    """
    if ref_kv is not None:
        k = mx.concatenate([k, ref_kv[0]], axis=2)  # (B, H, L + Lr, hd)
        v = mx.concatenate([v, ref_kv[1]], axis=2)
    B, H, L, hd = q.shape
    rows = max(1, SCORE_LIMIT // (B * H * k.shape[2]))  # queries per call: scores under the limit
    chunks = [q] if rows >= L else [q[:, :, i : i + rows] for i in range(0, L, rows)]  # each sees every key
    out = [mx.fast.scaled_dot_product_attention(c, k, v, scale=hd**-0.5) for c in chunks]  # (B, H, rows, hd)
    out = out[0] if len(out) == 1 else mx.concatenate(out, axis=2)  # one call below the limit, as before
    return out.transpose(0, 2, 1, 3).reshape(B, L, H * hd)
