"""`serve` with img2img and inpainting: `/v1/images/edits` with `mask` and/or `strength` treats the
first image as the init image, and the PNG equals `FluxKleinPipeline.generate` on the same request."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

# The server, its tiny snapshot and the in-process pipeline are test_serve's fixtures.
from test_serve import decode, picture, pipe, png, server, snapshot  # noqa: F401


def test_inpainting_and_img2img_through_the_server_match_the_pipeline(server, pipe):  # noqa: F811
    init = picture(100, 72, 4)  # resized to 96x64, as the pipeline does
    mask = Image.new("L", init.size, 0)
    ImageDraw.Draw(mask).ellipse((20, 10, 80, 60), fill=255)
    client = server.client()
    res = client.images.edit(image=("a.png", png(init), "image/png"), mask=("m.png", png(mask), "image/png"),
                             prompt="a cat", extra_body={"seed": 3, "steps": 4, "strength": 0.75})
    im = decode(res.data[0].b64_json)
    ours = pipe.generate("a cat", init_image=init, mask=mask, strength=0.75, seed=3, steps=4)
    assert im.size == ours.size == (96, 64)
    np.testing.assert_array_equal(np.asarray(im.convert("RGB")), np.asarray(ours))

    res = client.images.edit(image=("a.png", png(init), "image/png"), prompt="a cat",
                             extra_body={"seed": 3, "steps": 4, "strength": 0.5})
    ours = pipe.generate("a cat", init_image=init, strength=0.5, seed=3, steps=4)
    np.testing.assert_array_equal(np.asarray(decode(res.data[0].b64_json).convert("RGB")), np.asarray(ours))
