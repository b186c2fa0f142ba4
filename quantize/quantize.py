#!/usr/bin/env python
"""Quantize a converted MLX folder to 4 or 8 bits: `python quantize/quantize.py --model ... --bits 4 --output ...`.

The same as `python -m flux_klein_mlx quantize`; see quantize/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flux_klein_mlx.__main__ import main  # noqa: E402  (imports no mlx; preloads OpenBLAS before it)

if __name__ == "__main__":
    sys.exit(main(["quantize", *sys.argv[1:]]))
