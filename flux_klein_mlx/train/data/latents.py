"""A run's VAE latents: read from the latent cache where they are, the rest encoded once with the VAE
(loaded only then, released after) and stored there, so a resume or a rerun never loads the VAE.

The cache is the prompt cache's machinery (`embedding_cache.EmbeddingCache`: bounded, least recently
used first out, whole-file writes, a damaged entry ignored and removed) in its own folder,
`<cache folder>/latents/` (default 1 GiB, about 4,000 images at 512² in bfloat16). An entry is the
(1, L, C) latent tokens of one image at one training size, bit for bit; its key holds everything
that decides them:

    the image's bytes (sha256), its training size (W, H), the crop rule (data.CROP_RULE), the flip,
    the VAE's weight files (path, size, mtime, header digest: as the prompt cache keys its encoder),
    the dtype, and the versions of MLX and of this package.

The log says what is left before the VAE loads, as the captions' does (train/data/captions.py):

    encoding 5 images with the VAE ...
    latents: 5 images: all in the latent cache, the VAE is not loaded
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from ...errors import FluxKleinError
from ...run.components import check_weights
from ...storage.embedding_cache import DEFAULT_MAX_BYTES, EmbeddingCache, default_folder
from ..report.events import StageFinished, StageStarted, plural
from .dataset import CROP_RULE, Picture, load_pixels

LATENTS_SUBFOLDER = "latents"


class LatentCache:
    """(picture, bucket, flip) -> (1, L, C) latent tokens of a run, from the latent cache or the VAE.

    `want` lists what the run needs (a list of requests), `plan` reads what the cache holds and says what
    is left, `encode` encodes the rest with the VAE of `load_component` (the trainer's: tests count the
    loads); `get` then serves every request."""

    def __init__(self, settings, info, dtype):
        self.settings = settings
        self.info = info
        self.dtype = dtype
        self.cache = EmbeddingCache(default_folder() / LATENTS_SUBFOLDER, DEFAULT_MAX_BYTES)
        self.wanted: dict[tuple, str | None] = {}  # (sha256, bucket, flip) -> cache key (None: not cached)
        self.paths: dict[tuple, object] = {}  # (sha256, bucket, flip) -> the image file
        self.tokens: dict[tuple, mx.array] = {}  # (sha256, bucket, flip) -> (1, L, C)
        self.images = 0  # the training images (not their controls, sizes or flips), for the log
        self.unchecked = False  # the plan did not check the VAE's weight files (every latent was stored)

    def want(self, picture: Picture, bucket: tuple[int, int], flip: bool = False) -> None:
        request = (picture.sha256, tuple(bucket), bool(flip))
        if request not in self.wanted:
            self.wanted[request] = self._key(picture, bucket, flip)
            self.paths[request] = picture.path

    def stored(self) -> bool:
        """Whether an entry is on disk for every request (read by `plan`; a damaged one is encoded then)."""
        return all(key is not None and self.cache.path_of(key).is_file() for key in self.wanted.values())

    def _key(self, picture: Picture, bucket, flip: bool) -> str | None:
        try:
            return self.cache.entry_key(
                self.info.files["vae"],
                purpose="vae latents",
                image=picture.sha256,
                size=list(bucket),
                crop=CROP_RULE,
                flip=bool(flip),
                dtype=self.settings.dtype,
            )
        except OSError:  # a VAE file that cannot be stat'ed: not cached; its load says what is wrong
            return None

    def plan(self, images: int, controls: int) -> StageStarted:
        """Read what the latent cache holds; say what is left to encode."""
        self.images = images
        for request, key in self.wanted.items():
            if key is not None and (hit := self.cache.get(key)) is not None:
                self.tokens[request] = hit
        also = f" + {plural(controls, 'control image')}" if controls else ""
        what = f"{plural(images, 'image')}{also}"
        missing = len(self.wanted) - len(self.tokens)
        if not missing:
            return StageStarted(stage="latents", detail=f"{what}: all in the latent cache, the VAE is not loaded")
        cached = len(self.wanted) - missing
        source = f" ({missing} of {len(self.wanted)} latents; {cached} from the latent cache)" if cached else ""
        return StageStarted(stage="latents", detail=f"encoding {what} with the VAE{source} ...")

    def encode(self, load_component: Callable) -> StageFinished:
        """Encode what `plan` did not find (the VAE loaded only then, released after) and store it."""
        t0 = time.perf_counter()
        missing = [r for r in self.wanted if r not in self.tokens]
        if not missing:
            return StageFinished(stage="latents", seconds=time.perf_counter() - t0, detail="read from the latent cache")
        if self.unchecked:  # the plan left the VAE's files unchecked (all stored): its headers now, one line
            check_weights(self.info, ("vae",))
        vae = load_component(self.info, "vae", self.dtype)
        for request in missing:
            _, bucket, flip = request
            path = self.paths[request]
            pixels = mx.array(load_pixels(path, bucket, flip))[None].astype(self.dtype)  # (1, H, W, 3)
            tokens = vae.encode_to_tokens(pixels)  # (1, H/16 * W/16, C)
            mx.eval(tokens)
            if not mx.all(mx.isfinite(tokens)).item():
                raise FluxKleinError(f"non-finite VAE latents for {path}: try --dtype float32")
            self.tokens[request] = tokens
            if self.wanted[request] is not None:  # a resume or rerun reads them back, bit for bit
                self.cache.put(self.wanted[request], tokens)
        del vae
        mx.clear_cache()
        cached = len(self.wanted) - len(missing)
        also = f", {cached} from the latent cache" if cached else ""
        return StageFinished(
            stage="latents",
            seconds=time.perf_counter() - t0,
            detail=f"{plural(len(missing), 'latent')} encoded{also}, VAE released",
        )

    def get(self, picture: Picture, bucket: tuple[int, int], flip: bool = False) -> mx.array:
        """The (1, L, C) tokens of a request `want` listed."""
        return self.tokens[(picture.sha256, tuple(bucket), bool(flip))]


def run_latents(settings, info, dtype, *, items: list, held_out: list) -> LatentCache:
    """The latents a run needs: each example's image and controls at its size (under --flip mirrored too), and
    the held-out images'."""
    latents = LatentCache(settings, info, dtype)
    for it in items + held_out:
        for picture in [it.image, *it.controls]:
            latents.want(picture, it.bucket)
    if settings.flip:  # each training example mirrored too (its controls with it); held-out images never
        for it in items:
            for picture in [it.image, *it.controls]:
                latents.want(picture, it.bucket, flip=True)
    return latents
