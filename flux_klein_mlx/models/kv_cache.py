"""The reference K/V cache of FLUX.2 [klein] 9B-KV: reference images computed once per image.

The KV model was distilled so that reference-image tokens attend only to themselves and are
modulated at a fixed timestep 0. Nothing they compute then depends on the prompt, the noise or
the step, so their keys and values (after QK-norm and RoPE) can be computed once, stored per block,
and shown to the target and text tokens of every step as extra keys/values, without the reference
tokens in the sequence. `FluxKlein.reference_kv` fills a `ReferenceKV`;
`FluxKlein.forward_with_rope(..., reference_kv=cache)` uses it.

Size: (double + single blocks) x 2 (K and V) x reference tokens x hidden x bytes per value;
klein-9B, one 1024x1024 reference (4096 tokens), bf16: 32 x 2 x 4096 x 4096 x 2 B = 2.15 GB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

KV = tuple[mx.array, mx.array]  # (keys, values), each (B, H, Lr, hd), keys already rotated


@dataclass
class ReferenceKV:
    """Keys and values of the reference tokens in every block, after RoPE; lives for one image."""

    double: list[KV] = field(default_factory=list)  # one (k, v) per double-stream block
    single: list[KV] = field(default_factory=list)  # one (k, v) per single-stream block

    @property
    def num_tokens(self) -> int:
        """Reference tokens held (the sum over all references)."""
        return (self.double or self.single)[0][0].shape[2]  # keys (B, H, Lr, hd)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every cached array (for `mx.eval`)."""
        return [a for kv in self.double + self.single for a in kv]


def cache_nbytes(num_blocks: int, tokens: int, hidden: int, bytes_per_value: int = 2) -> int:
    """Size of a reference cache: blocks x 2 (K, V) x tokens x hidden x bytes."""
    return num_blocks * 2 * tokens * hidden * bytes_per_value
