"""The seam of an outpaint: how much the colour jumps across the join, ours against a plain inpaint.

    python benchmarks/outpaint_seam.py --model black-forest-labs/FLUX.2-klein-4B [--steps 4] [--pads 0,0,256,0]

Test images: smooth synthetic pictures (colour gradients with soft blobs, 256x256, seeded). Each is
outpainted twice on the same canvas, by the same seed:
- `outpaint`: `generate(init_image=..., outpaint=pads)`, the method of docs/generating.md#outpainting
  (the new area and a 32-px band inpainted, the original put back beyond the band, a cross-fade in it);
- `plain_inpaint`: the padded canvas (edge pixels repeated) inpainted with a mask of the new area only,
  the whole decoded image kept (what an inpaint node does with a padded image).
Two figures, in 0-255 colour levels, averaged over the images and the three channels:
- `seam_step`: the mean |colour difference| between the 4-px strips either side of the join (the new
  area's against the original area's, pixel row by pixel row), less the same figure one strip further
  inside the original (the picture's own change over that distance; below 0: smoother than the picture);
- `kept_shift`: the mean |result - original| beyond the band: 0 when the original is kept bit for bit.
One line per image, then the summary as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when a test loads this file
import common  # noqa: E402,F401  (this checkout on sys.path, OpenBLAS preloaded)

STRIP = 4  # px either side of the join
BAND = 32  # outpaint.SEAM: beyond it the original is kept


def picture(size: int, seed: int):
    """A smooth synthetic picture: a colour gradient with three soft blobs (uint8 PIL)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    img = rng.uniform(0, 1, 3) * x[..., None] + rng.uniform(0, 1, 3) * y[..., None]
    for _ in range(3):
        cy, cx, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.08, 0.2)
        img += rng.uniform(-0.5, 0.5, 3) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / r**2)[..., None]
    return Image.fromarray((np.clip(img / img.max(), 0, 1) * 255).astype(np.uint8))


def strips(result: np.ndarray, pads, size: int) -> tuple[float, float]:
    """(the jump across the join, the same measure one strip further inside) on the first padded side: the
    mean |difference| of the strips' mean colours, row by row along the join (0-255 levels)."""
    left, top, right, bottom = pads
    a = result.astype(np.float32)
    if not (left or right):  # a top or bottom join: transposed, it is a left or right one
        a, left, right, top = a.transpose(1, 0, 2), top, bottom, left
    if not right:  # a left join: mirrored, it is a right one
        a, left = a[:, ::-1], right
    edge, rows = left + size, slice(top, top + size)  # the first column past the original; its rows

    def strip(k):  # the k-th STRIP-px strip from the join (0: the first new one, -1: the last original one)
        return a[rows, edge + k * STRIP : edge + (k + 1) * STRIP].mean(1)

    return float(np.abs(strip(0) - strip(-1)).mean()), float(np.abs(strip(-1) - strip(-2)).mean())


def measure(pipe, image, pads, args, seed: int) -> dict:
    from PIL import Image

    from flux_klein_mlx.inputs.outpaint import outpaint_canvas

    size = image.width
    canvas, _, outpainting = outpaint_canvas(image, pads)
    new_only = (outpainting.alpha == 1).astype(np.uint8) * 255  # the plain inpaint's mask: the new area only

    run = dict(steps=args.steps, seed=seed)
    ours = np.asarray(pipe.generate(args.prompt, init_image=image, outpaint=pads, **run).convert("RGB"))
    plain = np.asarray(
        pipe.generate(args.prompt, init_image=canvas, mask=Image.fromarray(new_only), strength=1.0, **run).convert(
            "RGB"
        )
    )
    kept = outpainting.alpha == 0
    original = outpainting.original
    figures = {}
    for name, result in (("outpaint", ours), ("plain_inpaint", plain)):
        jump, own = strips(result, pads, size)
        shift = float(np.abs(result[kept].astype(np.float32) - original[kept]).mean())
        figures[name] = {"seam_step": jump - own, "kept_shift": shift}
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pads", default="0,0,128,0", help="LEFT,TOP,RIGHT,BOTTOM (one side is measured)")
    parser.add_argument("--images", type=int, default=3)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--prompt", default="a wide landscape photograph")
    args = parser.parse_args(argv)

    import flux_klein_mlx
    from flux_klein_mlx.inputs.outpaint import parse_outpaint

    pads = parse_outpaint(args.pads)
    pipe = flux_klein_mlx.load(args.model, dtype=args.dtype)
    total = {"outpaint": {"seam_step": 0.0, "kept_shift": 0.0}, "plain_inpaint": {"seam_step": 0.0, "kept_shift": 0.0}}
    for k in range(args.images):
        figures = measure(pipe, picture(args.size, k), pads, args, seed=k)
        ours, plain = figures["outpaint"], figures["plain_inpaint"]
        print(
            f"image {k}: seam step ours {ours['seam_step']:.2f}, plain inpaint {plain['seam_step']:.2f}; "
            f"kept-region shift ours {ours['kept_shift']:.2f}, plain inpaint {plain['kept_shift']:.2f} (0-255 levels)"
        )
        for name in total:
            for key in total[name]:
                total[name][key] += figures[name][key] / args.images
    summary = {
        "images": args.images,
        "seam_step": {name: round(total[name]["seam_step"], 3) for name in total},
        "kept_shift": {name: round(total[name]["kept_shift"], 3) for name in total},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
