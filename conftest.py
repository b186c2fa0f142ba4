"""Root test configuration: fast BLAS for MLX on Linux, no hub access, one thread per worker."""

import os

# Never reach the Hugging Face hub from a test; hub code paths run against local caches.
os.environ["HF_HUB_OFFLINE"] = "1"

# Under pytest-xdist (README's `-n 2`) each worker has a core: one BLAS / OpenMP thread for it and for
# the processes its tests start, or the threads of both workers fight for the two cores (measured:
# 6 of 20 minutes in the kernel). Set before OpenBLAS loads below, which reads it once.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# MLX's Linux CPU wheel bundles a reference BLAS ~40x slower than OpenBLAS: bind OpenBLAS before
# anything imports mlx (quietly nothing where it is absent, e.g. on macOS).
from flux_klein_mlx import preload_openblas  # noqa: E402  (imports no mlx)

preload_openblas()
