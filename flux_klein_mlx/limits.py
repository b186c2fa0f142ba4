"""The largest image a backend can make: the machine's memory, and the VAE decode's buffers at a size.

The decode is where a large image's memory goes (the transformer's attention is split in query
chunks under MLX's CPU score limit: models/attention.SCORE_LIMIT). Per image of W x H pixels,
with the decoder's channels per level c_0 .. c_n (klein: 128, 256, 512, 512; c_1 = 256) at 2 B
(bfloat16) or 4 B (float32) per value:

- untiled, MLX's CPU conv (backend/cpu/conv.cpp, explicit_gemm_conv_ND_cpu) unfolds each 3x3 conv's
  input into one float32 im2col buffer of out_pixels x C_in x 9 values, whatever the dtype; the
  largest is a full-size conv reading c_1 channels: W·H·c_1·9·4 B (klein: 9.7 GB at 1024², 155 GB at
  4096²). A failed allocation in MLX's CPU backend is not an error: malloc's null is written to,
  SIGSEGV (backend/no_gpu/allocator.cpp), so this must never be tried past the machine's memory.
- tiled (`Decoder.decode_tiled`, bands of rows): no large temporary; the peak is the full-size
  activations alive in the first ResBlock of the last level: its input (c_1 channels) and three
  c_0-channel outputs (conv1, conv2, the shortcut): W·H·(c_1 + 3 c_0)·itemsize (klein bf16: 1.3 kB a
  pixel, 21.5 GB at 4096²). Derived from the decoder's code, not measured at that size: on this
  2-core machine a 128² decode with klein's widths did not finish in 5 minutes.

Metal (MLX's documented limits): a buffer past the device's `max_buffer_length` or an allocation
past its memory raises an error instead (metal/allocator.cpp), its 3x3 convs run as Winograd or
implicit GEMM and unfold in row tiles under `max_buffer_length` (metal/conv.cpp), and its fused
attention kernel (head dim 64, 80 or 128: klein's 128) builds no score matrix; what bounds a size
there is the same tiled-decode peak against the recommended working set, and the largest single
buffer (a full-size c_1-channel activation, 8 GiB at 4096² bf16) against `max_buffer_length`.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .errors import FluxKleinError
from .models.config import AutoEncoderConfig
from .models.rope import PIXELS_PER_TOKEN

# The share of the machine's memory an image's decode may take (MLX's CPU allocator takes 0.8 of the
# physical memory as its default limit, mx.get_memory_limit()); the models and the rest stay in the rest.
MEMORY_SHARE = 0.8
# The untiled decode is used only while its im2col buffer stays under this share of the machine, and
# under MLX's per-call index limit (2^31 elements; see models/attention.SCORE_LIMIT).
UNTILED_SHARE = 0.25
INDEX_LIMIT = 2**31 - 1


def machine_memory() -> tuple[int, str]:
    """(bytes a step may use, where that figure comes from): on a Mac MLX's recommended working set of
    the GPU (what Metal lets a process keep resident), else the physical memory."""
    info = _device_info()
    for key in ("max_recommended_working_set_size", "memory_size"):
        if info.get(key):
            return int(info[key]), f"MLX {key}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def _channels(config: AutoEncoderConfig) -> tuple[int, int]:
    """(c_0, c_1): the decoder's channels at full size and one level below (klein: 128, 256)."""
    ch = config.decoder_block_out_channels or config.block_out_channels
    return ch[0], ch[1] if len(ch) > 1 else ch[0]


def untiled_im2col_values(config: AutoEncoderConfig, width: int, height: int) -> int:
    """Values in the untiled decode's largest im2col buffer on MLX's CPU (float32): W·H·c_1·9."""
    return width * height * _channels(config)[1] * 9


def tiled_decode_bytes(config: AutoEncoderConfig, width: int, height: int, itemsize: int) -> int:
    """The tiled decode's peak: W·H·(c_1 + 3 c_0)·itemsize (see the module docstring)."""
    c0, c1 = _channels(config)
    return width * height * (c1 + 3 * c0) * itemsize


def untiled_decode_fits(config: AutoEncoderConfig, width: int, height: int) -> bool:
    """Whether the whole-image decode is safe. On MLX's CPU: its im2col buffer under MLX's index limit and
    under UNTILED_SHARE of the machine. On Metal (no im2col of the whole image, see the module docstring):
    its largest activation under `max_buffer_length`. Past it the pipeline decodes in bands (the same image)."""
    if mx.default_device() == mx.gpu:
        max_buffer = _device_info().get("max_buffer_length") or 0
        return not max_buffer or width * height * _channels(config)[1] * 4 <= max_buffer
    values = untiled_im2col_values(config, width, height)
    return values <= INDEX_LIMIT and values * 4 <= UNTILED_SHARE * machine_memory()[0]


def check_decode_fits(width: int, height: int, itemsize: int = 2, config: AutoEncoderConfig | None = None) -> None:
    """Refuse, in one line, a size whose tiled decode would not fit this machine (klein's decoder and
    bfloat16 unless told: the least any klein run needs), or whose largest buffer Metal cannot hold."""
    config = config or AutoEncoderConfig()
    need = tiled_decode_bytes(config, width, height, itemsize)
    memory, source = machine_memory()
    largest = width * height * _channels(config)[1] * itemsize  # one full-size c_1-channel activation
    max_buffer = (_device_info().get("max_buffer_length") or 0) if mx.default_device() == mx.gpu else 0
    if need <= MEMORY_SHARE * memory and (not max_buffer or largest <= max_buffer):
        return
    side = _largest_square(config, itemsize, MEMORY_SHARE * memory, max_buffer)
    why = (
        f"its VAE decode needs about {need / 1e9:.1f} GB even in bands and this machine has "
        f"{memory / 1e9:.1f} GB ({source}; an image may use {MEMORY_SHARE:.0%})"
        if need > MEMORY_SHARE * memory
        else f"one of its VAE buffers is {largest / 1e9:.1f} GB, past Metal's max_buffer_length "
        f"({max_buffer / 1e9:.1f} GB)"
    )
    raise FluxKleinError(f"{width}x{height} is too large for this machine: {why}; use at most about {side}x{side}")


def _device_info() -> dict:
    try:  # an MLX without device_info: the OS's figures
        return mx.device_info()
    except Exception:
        return {}


def _largest_square(config: AutoEncoderConfig, itemsize: int, budget: float, max_buffer: int) -> int:
    """The largest multiple-of-16 side s whose s x s decode fits `budget` (and `max_buffer`, if any)."""
    c0, c1 = _channels(config)
    pixels = budget / ((c1 + 3 * c0) * itemsize)
    if max_buffer:
        pixels = min(pixels, max_buffer / (c1 * itemsize))
    return max(PIXELS_PER_TOKEN, int(pixels**0.5) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)
