#!/usr/bin/env python
"""Quantize a converted MLX folder to 4 or 8 bits: `python quantize/quantize.py --model ... --bits 4 --output ...`.

The same as `python -m flux_klein_mlx quantize`; see quantize/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flux_klein_mlx import preload_openblas  # noqa: E402  (imports no mlx)

preload_openblas()  # before mlx is imported (Linux speed; a no-op on macOS)

from flux_klein_mlx.quantize import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
