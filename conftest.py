"""Root test configuration: fast BLAS for MLX on Linux, and no hub access."""

import ctypes
import ctypes.util
import os

# Never reach the Hugging Face hub from a test; hub code paths run against local caches.
os.environ["HF_HUB_OFFLINE"] = "1"

# MLX's Linux CPU wheel bundles a reference BLAS ~40x slower than OpenBLAS. Loading OpenBLAS
# globally before mlx is imported makes MLX bind to it. Quietly skipped where it is absent (macOS).
_openblas = ctypes.util.find_library("openblas")
if _openblas:
    try:
        ctypes.CDLL(_openblas, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass
