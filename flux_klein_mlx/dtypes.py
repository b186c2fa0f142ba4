"""The dtypes a run may ask for, by name, and the default one: every command, the server, the Python API,
the trainer and the benchmark read them here (the bottom floor: it imports only `checks`)."""

from __future__ import annotations

import mlx.core as mx

from .checks import check_choice

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
DEFAULT_DTYPE = "bfloat16"  # weights and activations of every command, the server and the Python API


def as_dtype(dtype) -> mx.Dtype | None:
    """None, an mx.Dtype or its name ("bfloat16", "float16", "float32") -> mx.Dtype or None."""
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    check_choice("dtype", dtype, DTYPES)
    return DTYPES[dtype]


def dtype_name(dtype: mx.Dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)
