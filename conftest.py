"""Root test configuration: fast BLAS for MLX on Linux, and no hub access."""

import os

# Never reach the Hugging Face hub from a test; hub code paths run against local caches.
os.environ["HF_HUB_OFFLINE"] = "1"

# MLX's Linux CPU wheel bundles a reference BLAS ~40x slower than OpenBLAS: bind OpenBLAS before
# anything imports mlx (quietly nothing where it is absent, e.g. on macOS).
from flux_klein_mlx import preload_openblas  # noqa: E402  (imports no mlx)

preload_openblas()
