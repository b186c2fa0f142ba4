#!/usr/bin/env python
"""Convert a FLUX.2 [klein] model into an MLX folder: `python convert/convert.py --model ... --output ...`.

The same as `python -m flux_klein_mlx convert`; see convert/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flux_klein_mlx.__main__ import main  # noqa: E402  (imports no mlx; preloads OpenBLAS before it)

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
