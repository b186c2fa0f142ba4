"""The FLUX.2 VAE (diffusers `AutoencoderKLFlux2`, BFL `AutoEncoder`) in NHWC, and the latent path
between the VAE and the transformer's tokens (2x2 patchify, frozen BatchNorm, packing).

Layout: every image and latent here is channels-last, (B, H, W, C). The references are NCHW; the
spec's channel formulas are stated for NCHW and are kept exactly (see `patchify`).

Module attribute names follow the diffusers checkpoint keys, except that `quant_conv` lives inside
the encoder and `post_quant_conv` inside the decoder (as in BFL's file), so `Encoder` maps images to
the posterior mean and `Decoder` maps latents to images on their own.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn

from ..errors import FluxKleinError
from .config import AutoEncoderConfig

# ---------------------------------------------------------------------------- building blocks


def _group_norm(groups: int, channels: int) -> nn.GroupNorm:
    # pytorch_compatible: PyTorch groups *consecutive* channels; MLX's default interleaves them.
    return nn.GroupNorm(groups, channels, eps=1e-6, pytorch_compatible=True)


class ResnetBlock2D(nn.Module):
    """h = conv2(silu(norm2(conv1(silu(norm1(x)))))); out = shortcut(x) + h."""

    def __init__(self, in_channels: int, out_channels: int, groups: int):
        super().__init__()
        self.norm1 = _group_norm(groups, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _group_norm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.conv1(nn.silu(self.norm1(x)))
        h = self.conv2(nn.silu(self.norm2(h)))
        if "conv_shortcut" in self:
            x = self.conv_shortcut(x)
        return x + h


class Attention(nn.Module):
    """Single-head self-attention over all pixels, with a residual add (the VAE's mid block)."""

    # Queries per attention call: bounds the (chunk, H*W) score matrix at large images (at 2048^2
    # the full matrix would be 65536^2 floats); chunks are exact, each sees every key.
    query_chunk = 4096

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = _group_norm(groups, channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = [nn.Linear(channels, channels)]

    def __call__(self, x: mx.array) -> mx.array:
        B, H, W, C = x.shape
        h = self.group_norm(x).reshape(B, 1, H * W, C)  # (B, heads=1, L, C)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        scale = 1.0 / math.sqrt(C)
        chunks = range(0, H * W, self.query_chunk)
        o = [mx.fast.scaled_dot_product_attention(q[:, :, i : i + self.query_chunk], k, v, scale=scale) for i in chunks]
        o = o[0] if len(o) == 1 else mx.concatenate(o, axis=2)  # (B, 1, L, C); one chunk needs no copy
        return x + self.to_out[0](o).reshape(B, H, W, C)


class Downsample2D(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def __call__(self, x: mx.array) -> mx.array:
        # Asymmetric padding, right and bottom only (as the references), then a stride-2 conv.
        return self.conv(mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)]))  # conv of (B, H+1, W+1, C)


def _nearest2x(x: mx.array) -> mx.array:
    """Nearest-neighbour x2, (B, H, W, C) -> (B, 2H, 2W, C): each pixel repeated into a 2x2 block."""
    B, H, W, C = x.shape
    return mx.broadcast_to(x[:, :, None, :, None, :], (B, H, 2, W, 2, C)).reshape(B, 2 * H, 2 * W, C)


class Upsample2D(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.conv(_nearest2x(x))


class DownEncoderBlock2D(nn.Module):
    """ResBlocks, then (if `resample`) one 2x resampler under the checkpoint's name for it; the
    decoder's `UpDecoderBlock2D` is the same with `upsamplers`."""

    resampler = ("downsamplers", Downsample2D)

    def __init__(self, in_channels: int, out_channels: int, layers: int, groups: int, resample: bool):
        super().__init__()
        self.resnets = [
            ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, groups) for i in range(layers)
        ]
        if resample:
            name, cls = self.resampler
            self[name] = [cls(out_channels)]

    def __call__(self, x: mx.array) -> mx.array:
        for r in self.resnets:
            x = r(x)
        name = self.resampler[0]
        return self[name][0](x) if name in self else x


class UpDecoderBlock2D(DownEncoderBlock2D):
    resampler = ("upsamplers", Upsample2D)


class UNetMidBlock2D(nn.Module):
    """ResBlock -> (Attention) -> ResBlock at the lowest resolution."""

    def __init__(self, channels: int, groups: int, attention: bool):
        super().__init__()
        self.resnets = [ResnetBlock2D(channels, channels, groups) for _ in range(2)]
        self.attentions = [Attention(channels, groups)] if attention else []

    def __call__(self, x: mx.array) -> mx.array:
        x = self.resnets[0](x)
        for a in self.attentions:
            x = a(x)
        return self.resnets[1](x)


# ------------------------------------------------------------------------------------- model


class Encoder(nn.Module):
    """Images (B, H, W, 3) in [-1, 1] -> posterior mean (B, H/8, W/8, latent_channels)."""

    def __init__(self, config: AutoEncoderConfig):
        super().__init__()
        ch, g = config.block_out_channels, config.norm_num_groups
        self.latent_channels = config.latent_channels
        self.conv_in = nn.Conv2d(config.in_channels, ch[0], 3, padding=1)
        self.down_blocks = [
            DownEncoderBlock2D(ch[max(i - 1, 0)], ch[i], config.layers_per_block, g, resample=i < len(ch) - 1)
            for i in range(len(ch))
        ]
        self.mid_block = UNetMidBlock2D(ch[-1], g, config.mid_block_add_attention)
        self.conv_norm_out = _group_norm(g, ch[-1])
        # Moments: mean and log-variance, 2 * latent_channels.
        self.conv_out = nn.Conv2d(ch[-1], 2 * config.latent_channels, 3, padding=1)
        if config.use_quant_conv:
            self.quant_conv = nn.Conv2d(2 * config.latent_channels, 2 * config.latent_channels, 1)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.conv_in(x.astype(self.conv_in.weight.dtype))
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        x = self.conv_out(nn.silu(self.conv_norm_out(x)))
        if "quant_conv" in self:
            x = self.quant_conv(x)
        # The references use the posterior mean (the mode), never a sample; log-variance unused.
        return x[..., : self.latent_channels]


class Decoder(nn.Module):
    """Latents (B, h, w, latent_channels) -> images (B, 8h, 8w, 3), nominally in [-1, 1]."""

    def __init__(self, config: AutoEncoderConfig):
        super().__init__()
        ch = config.decoder_block_out_channels or config.block_out_channels
        g = config.norm_num_groups
        if config.use_post_quant_conv:
            self.post_quant_conv = nn.Conv2d(config.latent_channels, config.latent_channels, 1)
        self.conv_in = nn.Conv2d(config.latent_channels, ch[-1], 3, padding=1)
        self.mid_block = UNetMidBlock2D(ch[-1], g, config.mid_block_add_attention)
        rev = list(reversed(ch))
        # One more ResBlock per level than the encoder; no upsample after the last level.
        self.up_blocks = [
            UpDecoderBlock2D(rev[max(i - 1, 0)], rev[i], config.layers_per_block + 1, g, resample=i < len(ch) - 1)
            for i in range(len(ch))
        ]
        self.conv_norm_out = _group_norm(g, ch[0])
        self.conv_out = nn.Conv2d(ch[0], config.out_channels, 3, padding=1)

    def _mid(self, z: mx.array) -> mx.array:
        z = z.astype(self.conv_in.weight.dtype)
        if "post_quant_conv" in self:
            z = self.post_quant_conv(z)
        return self.mid_block(self.conv_in(z))

    def __call__(self, z: mx.array) -> mx.array:
        x = self._mid(z)
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(nn.silu(self.conv_norm_out(x)))

    def decode_tiled(self, z: mx.array, tile_pixels: int = 1 << 16) -> mx.array:
        """`self(z)` with bounded peak memory: the same numbers, computed tile by tile.

        Tiles are full-width bands of rows. Past the mid block every 3x3 conv runs on bands of at
        most `tile_pixels` output pixels (at least one row), each band reading its one-row halo
        from the neighbouring rows, so a band sees exactly what the whole-image conv sees: there
        are no seams to blend. GroupNorm statistics are reduced over the whole image (band by
        band, in float32) and applied band by band, fused with SiLU into the conv's input, and the
        nearest-neighbour upsample is done per band, so the large temporaries (the convs' im2col
        buffers on the CPU, the normalised and the upsampled copies) never exist at full size. The
        mid block (attention is global) runs whole at the latent resolution, where it is small.
        What remains at full size is a few activations per layer; each layer is evaluated before
        the next. It differs from `self(z)` only by float rounding.
        """
        x = self._mid(z)
        for block in self.up_blocks:
            for r in block.resnets:
                x = _resnet_tiled(r, x, tile_pixels)
            if "upsamplers" in block:
                x = _conv_tiled(block.upsamplers[0].conv, x, tile_pixels, upsample=True)
        return _conv_tiled(self.conv_out, x, tile_pixels, norm=self.conv_norm_out)


def _norm_stats(norm: nn.GroupNorm, x: mx.array, band: int) -> tuple[mx.array, mx.array]:
    """GroupNorm mean and 1/std of (B, H, W, C) over the whole image, reduced band by band in
    float32 (two passes: mean, then centred squares, which does not cancel like E[x^2] - E[x]^2)."""
    B, H, W, C = x.shape
    G = norm.num_groups
    n = H * W * (C // G)

    def groups(a, b):  # (B, rows, W, G, C/G): PyTorch groups consecutive channels
        return x[:, a:b].astype(mx.float32).reshape(B, b - a, W, G, C // G)

    def total(t):  # (B, 1, 1, G, 1); summed per row, then rows, then bands: short fp32 sums
        return t.sum(axis=(2, 4), keepdims=True).sum(axis=1, keepdims=True)

    bands = [(a, min(a + band, H)) for a in range(0, H, band)]
    mean = sum(total(groups(a, b)) for a, b in bands) / n
    var = sum(total(mx.square(groups(a, b) - mean)) for a, b in bands) / n
    mx.eval(mean, var)
    return mean, mx.rsqrt(var + norm.eps)


def _conv_tiled(
    conv: nn.Conv2d, x: mx.array, tile_pixels: int, norm: nn.GroupNorm | None = None, upsample: bool = False
) -> mx.array:
    """conv(x), or conv(silu(norm(x))), or conv(upsample2x(x)), computed on bands of output rows.

    Only stride-1 convs with padding k // 2 (all the decoder has). Each band takes its input rows
    plus the halo, applies the norm/upsample to just those rows, then zero-pads only where the
    band touches the image border, as the whole-image conv's padding does.
    """
    B, H, W, C = x.shape
    Hout, Wout = (2 * H, 2 * W) if upsample else (H, W)
    halo = conv.weight.shape[1] // 2  # k // 2 of the (O, k, k, I) kernel
    band = max(1, tile_pixels // Wout)
    if norm is not None:
        mean, rstd = _norm_stats(norm, x, band)
        G = norm.num_groups

    def rows(a: int, b: int) -> mx.array:  # input rows [a, b) of what the conv reads, (B, b-a, Wout, C)
        if upsample:
            lo, hi = a // 2, (b - 1) // 2 + 1  # source rows covering upsampled rows a..b-1
            return _nearest2x(x[:, lo:hi])[:, a - 2 * lo : b - 2 * lo]  # (B, b-a, 2W, C)
        t = x[:, a:b]
        if norm is None:
            return t
        g = (t.astype(mx.float32).reshape(B, b - a, W, G, C // G) - mean) * rstd
        g = g.reshape(B, b - a, W, C) * norm.weight + norm.bias
        return nn.silu(g).astype(x.dtype)

    # Bands are written into one preallocated output (slice updates donate the buffer, so this
    # is in place), not concatenated, which would hold the output twice.
    out = mx.zeros((B, Hout, Wout, conv.weight.shape[0]), x.dtype)
    for r0 in range(0, Hout, band):
        r1 = min(r0 + band, Hout)
        a, b = max(r0 - halo, 0), min(r1 + halo, Hout)
        t = rows(a, b)
        pad = (halo - (r0 - a), halo - (b - r1))  # zero rows only at the image's top/bottom
        if pad != (0, 0):
            t = mx.pad(t, [(0, 0), pad, (0, 0), (0, 0)])
        out[:, r0:r1] = mx.conv2d(t, conv.weight, padding=(0, halo)) + conv.bias  # (B, r1-r0, Wout, O)
        mx.eval(out)
    return out


def _resnet_tiled(r: ResnetBlock2D, x: mx.array, tile_pixels: int) -> mx.array:
    h = _conv_tiled(r.conv1, x, tile_pixels, norm=r.norm1)
    h = _conv_tiled(r.conv2, h, tile_pixels, norm=r.norm2)
    if "conv_shortcut" in r:
        x = _conv_tiled(r.conv_shortcut, x, tile_pixels)
    h = h + x  # rebinding h lets the sum reuse h's buffer
    mx.eval(h)
    return h


class LatentNorm(nn.Module):
    """The frozen BatchNorm statistics over the patchified latent channels (no affine)."""

    def __init__(self, channels: int):
        super().__init__()
        self.running_mean = mx.zeros((channels,))
        self.running_var = mx.ones((channels,))
        # Statistics, not learnable parameters: loaded with the weights but never trained/counted.
        self.freeze()

    def unfreeze(self, *args, **kwargs):
        super().unfreeze(*args, **kwargs)
        return self.freeze()


# The latent path, as pure functions on NHWC arrays (B, h, w, C) and tokens (B, h*w, C).


def patchify(z: mx.array, patch: tuple[int, int] = (2, 2)) -> mx.array:
    """(B, H, W, C) -> (B, H/ph, W/pw, C*ph*pw), new channel index c*ph*pw + py*pw + px.

    The channel order is the references' NCHW one (view (B,C,h,2,w,2) -> permute to (B,C,2,2,h,w)),
    kept exactly so the transformer sees the channels it was trained on.
    """
    ph, pw = patch
    B, H, W, C = z.shape
    z = z.reshape(B, H // ph, ph, W // pw, pw, C)  # (B, y, py, x, px, c)
    z = z.transpose(0, 1, 3, 5, 2, 4)  # (B, y, x, c, py, px)
    return z.reshape(B, H // ph, W // pw, C * ph * pw)


def unpatchify(z: mx.array, patch: tuple[int, int] = (2, 2)) -> mx.array:
    """The inverse of `patchify`: (B, h, w, C*ph*pw) -> (B, h*ph, w*pw, C)."""
    ph, pw = patch
    B, h, w, CP = z.shape
    C = CP // (ph * pw)
    z = z.reshape(B, h, w, C, ph, pw)  # (B, y, x, c, py, px)
    z = z.transpose(0, 1, 4, 2, 5, 3)  # (B, y, py, x, px, c)
    return z.reshape(B, h * ph, w * pw, C)


def pack(z: mx.array) -> mx.array:
    """(B, h, w, C) -> tokens (B, h*w, C), token index y*w + x (row-major)."""
    B, h, w, C = z.shape
    return z.reshape(B, h * w, C)


def unpack(tokens: mx.array, h: int, w: int) -> mx.array:
    """Tokens (B, h*w, C) -> (B, h, w, C), the inverse of `pack`."""
    B, L, C = tokens.shape
    if L != h * w:
        raise FluxKleinError(f"{L} latent tokens do not fill a {h}x{w} grid ({h * w} tokens)")
    return tokens.reshape(B, h, w, C)


class AutoEncoder(nn.Module):
    """The whole VAE file: `encoder`, `decoder` and the latent statistics `bn`.

    Images are NHWC in [-1, 1]; tokens are what the transformer reads and writes: (B, h*w, 128)
    with h, w = H/16, W/16, normalised by the BatchNorm statistics.
    """

    def __init__(self, config: AutoEncoderConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.bn = LatentNorm(config.token_channels)

    def encode(self, images: mx.array) -> mx.array:
        """(B, H, W, 3) in [-1, 1] -> posterior mean (B, H/8, W/8, 32)."""
        return self.encoder(images)

    def decode(self, z: mx.array, tiled: bool = False, tile_pixels: int = 1 << 16) -> mx.array:
        """(B, h, w, 32) -> images (B, 8h, 8w, 3); `tiled` bounds peak memory (see `Decoder.decode_tiled`)."""
        return self.decoder.decode_tiled(z, tile_pixels) if tiled else self.decoder(z)

    def latents_to_tokens(self, z: mx.array) -> mx.array:
        """Posterior mean (B, H/8, W/8, 32) -> normalised tokens (B, H/16*W/16, 128)."""
        z = patchify(z, self.config.patch_size)  # (B, H/16, W/16, 128)
        # frozen BatchNorm over the channels: (z - mean) / sqrt(var + eps)
        rstd = mx.rsqrt(self.bn.running_var + self.config.batch_norm_eps).astype(z.dtype)
        return pack((z - self.bn.running_mean.astype(z.dtype)) * rstd)

    def tokens_to_latents(self, tokens: mx.array, h: int, w: int) -> mx.array:
        """Normalised tokens (B, h*w, 128) -> VAE latents (B, 2h, 2w, 32), the inverse of `latents_to_tokens`."""
        z = unpack(tokens, h, w)
        std = mx.sqrt(self.bn.running_var + self.config.batch_norm_eps).astype(z.dtype)
        return unpatchify(z * std + self.bn.running_mean.astype(z.dtype), self.config.patch_size)

    def encode_to_tokens(self, images: mx.array) -> mx.array:
        """Images (B, H, W, 3) in [-1, 1], sides multiples of 16 -> tokens (B, H/16*W/16, 128)."""
        m = self.config.size_multiple
        if images.ndim != 4 or images.shape[-1] != self.config.in_channels:
            raise FluxKleinError(f"expected images of shape (B, H, W, {self.config.in_channels}), got {images.shape}")
        if images.shape[1] % m or images.shape[2] % m:
            raise FluxKleinError(
                f"image size {images.shape[2]}x{images.shape[1]} is not a multiple of {m}; crop or resize it first"
            )
        return self.latents_to_tokens(self.encode(images))

    def decode_tokens(
        self, tokens: mx.array, h: int, w: int, tiled: bool = False, tile_pixels: int = 1 << 16
    ) -> mx.array:
        """Tokens (B, h*w, 128) on an h x w grid -> images (B, 16h, 16w, 3), nominally in [-1, 1].

        `tiled=True` bounds peak memory and evaluates as it goes (see `Decoder.decode_tiled`).
        """
        return self.decode(self.tokens_to_latents(tokens, h, w), tiled=tiled, tile_pixels=tile_pixels)


# ---------------------------------------------------------------------------------- sanitize

# BFL `ae.safetensors` names -> ours (= diffusers'), applied in order; decoder up-block indices are
# reversed separately because they need the number of levels.
_BFL_RENAMES = [
    (re.compile(r"^encoder\.down\.(\d+)\.block\.(\d+)\."), r"encoder.down_blocks.\1.resnets.\2."),
    (re.compile(r"^encoder\.down\.(\d+)\.downsample\."), r"encoder.down_blocks.\1.downsamplers.0."),
    (re.compile(r"\.nin_shortcut\."), ".conv_shortcut."),
    (re.compile(r"^(encoder|decoder)\.mid\.block_1\."), r"\1.mid_block.resnets.0."),
    (re.compile(r"^(encoder|decoder)\.mid\.block_2\."), r"\1.mid_block.resnets.1."),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\.norm\."), r"\1.mid_block.attentions.0.group_norm."),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\.([qkv])\."), r"\1.mid_block.attentions.0.to_\2."),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\.proj_out\."), r"\1.mid_block.attentions.0.to_out.0."),
    (re.compile(r"^(encoder|decoder)\.norm_out\."), r"\1.conv_norm_out."),
    # diffusers keeps the quant convs at the top level; ours (like BFL) keep them inside.
    (re.compile(r"^quant_conv\."), "encoder.quant_conv."),
    (re.compile(r"^post_quant_conv\."), "decoder.post_quant_conv."),
]
_BFL_UP = re.compile(r"^decoder\.up\.(\d+)\.(block|upsample)\.")
_ATTN_LINEAR = re.compile(r"\.attentions\.0\.(to_q|to_k|to_v|to_out\.0)\.weight$")


def _conv_layout_is_torch(weights: dict[str, mx.array]) -> bool:
    """Whether the 4-D (conv) weights are PyTorch (O, I, kh, kw) or already MLX (O, kh, kw, I).

    Decided per file from the weights whose shape tells: square 1x1/3x3 kernels sit on axes 2-3
    in PyTorch and 1-2 in MLX. Only a weight like encoder.conv_in (128, 3, 3, 3) can't tell, and
    every VAE has many that can. A file of only such weights is taken as PyTorch (the sources).
    """
    square = ((1, 1), (3, 3))
    convs = [tuple(v.shape) for v in weights.values() if v.ndim == 4]  # (O, I, kh, kw) or (O, kh, kw, I)
    torch_like = any(s[2:] in square and s[1:3] not in square for s in convs)
    mlx_like = any(s[1:3] in square and s[2:] not in square for s in convs)
    if torch_like and mlx_like:
        raise FluxKleinError(
            "the VAE weights mix PyTorch and MLX conv layouts; convert them again from the original files"
        )
    return not mlx_like


def sanitize_vae_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Map a diffusers `vae/` or BFL `ae.safetensors` state dict to our names and NHWC layout.

    BFL names are renamed (`_BFL_RENAMES`, decoder up-block indices reversed); BFL attention 1x1
    convs (C, C, 1, 1) become linear (C, C); conv weights (O, I, kh, kw) become (O, kh, kw, I).
    Idempotent: weights already in our names and layout pass through unchanged.
    """
    levels = 1 + max((int(m.group(1)) for k in weights if (m := _BFL_UP.match(k))), default=-1)
    out: dict[str, mx.array] = {}
    for k, v in weights.items():
        if k.endswith("num_batches_tracked"):
            continue
        if m := _BFL_UP.match(k):
            new = "resnets" if m.group(2) == "block" else "upsamplers.0"
            k = f"decoder.up_blocks.{levels - 1 - int(m.group(1))}.{new}." + k[m.end() :]
        for pattern, repl in _BFL_RENAMES:
            k = pattern.sub(repl, k)
        if _ATTN_LINEAR.search(k) and v.ndim == 4:
            v = v.reshape(v.shape[0], v.shape[1])  # 1x1 conv (C, C, 1, 1) -> linear (C, C)
        out[k] = v
    if _conv_layout_is_torch(out):
        out = {k: v.transpose(0, 2, 3, 1) if v.ndim == 4 else v for k, v in out.items()}
    return out


# ------------------------------------------------------------------------------------ loader


def check_flux2(config: AutoEncoderConfig | None, weights: dict[str, mx.array] | None) -> None:
    """A FLUX.1 VAE (16 latent channels, no latent statistics) has the same blocks: refuse it by name."""
    w = None if weights is None or "bn.running_mean" in weights else weights.get("decoder.conv_in.weight")
    if (config is not None and config.latent_channels == 16) or (w is not None and w.ndim == 4 and w.shape[-1] == 16):
        raise FluxKleinError(
            "this is a FLUX.1 VAE (16 latent channels); FLUX.2 [klein] needs the FLUX.2 VAE (32 channels)"
        )
