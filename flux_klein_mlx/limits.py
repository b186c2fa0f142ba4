"""The bounds of what a run may be asked: one table of every count a user, a file or a request can give
(issue 46), and the largest image a backend can make (the machine's memory, the VAE decode's buffers).

The table is read by every door alike: `inputs.RunSettings` (the CLI's generate, Python's generate(), the
server's requests, a record read by --from), `train.settings.TrainSettings` and the training data's
repeat folders, the server's forms. Each bound is checked before any model loads, and its message gives
the bound.

The largest image. The decode is where a large image's memory goes (the transformer's attention is split in query
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

# --- the table of bounds ------------------------------------------------------------------------------
# Denoising steps of a run (generate --steps, train --sample-steps, a record's steps): the flow-match
# scheduler's table has 1000 training timesteps, so more steps only repeat them; and FLUX.2's step-fitted
# shift (sampling.empirical_mu) falls by ~0.0076 a step: past ~98,600 steps (a 64x64 image) exp(mu) underflows to 0
# (a ZeroDivisionError), and the schedule's list of sigmas grows with the steps (10^9 filled the memory).
MAX_STEPS = 1000
MAX_TRAIN_STEPS = 10_000_000  # optimizer steps (train --steps, and those --epochs makes): 116 days at 1 a second
MAX_EPOCHS = 1_000_000  # train --epochs (and --save-every-epochs, ...); the steps they make: MAX_TRAIN_STEPS
# Draws of one image per epoch: --repeats, a kohya `N_name/` folder's N, and their product (an epoch's list
# holds every draw: 10,000 x 1,000 images is 10^7 entries, an 80 MB list).
MAX_REPEATS = 10_000
# Reference images of a run (--image, images=, uploads): BFL's bound for FLUX 3 and its prompt upsampler;
# FLUX.2 has none of its own, and each 1 MP reference adds 4,096 tokens to every step's attention.
MAX_REFERENCES = 10
# Characters of a prompt, a negative prompt, and of a run's layout boxes' texts together (a box's text is
# prompt text): OpenAI's gpt-image prompt limit, about 8,000 tokens of English: FLUX 3's window (8,192
# tokens, models/tokenizer.FLUX3_WINDOW) reads no more, FLUX.2's (512) far less.
MAX_PROMPT_CHARS = 32_000
# Layout boxes of a run (--box, boxes=, "boxes"): each is a row of the layout table the model reads, about
# 30 tokens before its text; 100 rows take 3,000 of FLUX 3's 8,192-token window.
MAX_BOXES = 100
# A seed of the noise (generate --seed, train --sample-seed, a record's seed): torch.Generator.manual_seed's range,
# the seeds diffusers takes (the noise keeps the low 32 bits: sampling.py); past it torch raises an overflow.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MIN_SIDE = 64  # px: the shortest side of an input image, and of an image drawn (spec 8.1)
MAX_SIDE = 4096  # px: the longest side drawn; ours (the references have none): 16x the pixels klein was tuned for
# px added on one side by an outpaint: the canvas side is at most MAX_SIDE and the image's at least MIN_SIDE.
MAX_OUTPAINT_PAD = MAX_SIDE - MIN_SIDE
# A path's bytes: one name between slashes (NAME_MAX of ext4 and APFS), the whole path (macOS's PATH_MAX;
# Linux allows 4096): past them the OS refuses the path (ENAMETOOLONG).
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 1024


def check_path(path, what: str) -> None:
    """Refuse, in one line, a path the OS would refuse (ENAMETOOLONG) or cannot hold (a NUL byte). `what`
    names it as its door does (--image, images=, "the init image")."""
    raw = os.fsencode(path)
    shown = os.fsdecode(raw[:60]) + ("..." if len(raw) > 60 else "")
    if b"\0" in raw:
        raise FluxKleinError(f"{what} {shown!r} holds a NUL character, which no path may; give the file's path")
    longest = max(len(name) for name in raw.split(b"/"))
    if len(raw) > MAX_PATH_BYTES or longest > MAX_NAME_BYTES:
        raise FluxKleinError(
            f"{what} {shown} is too long for a path ({len(raw)} bytes, a name of {longest}): the limits are "
            f"{MAX_PATH_BYTES} bytes a path and {MAX_NAME_BYTES} a name; use a shorter path"
        )


# --- the largest image ----------------------------------------------------------------------------------

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


# --- training over the API (serve's POST /v1/files and /v1/fine_tuning/jobs) -------------------------------
# An uploaded zip of training data: its bytes on the wire, its entries, what it unpacks to, and each image's
# pixels (read from its header before it is decoded: 50 MP is a 8K photo, and 200 MB of RGBA when decoded).
MAX_TRAINING_UPLOAD_BYTES = 2 << 30
MAX_TRAINING_ENTRIES = 20_000
MAX_TRAINING_UNPACKED_BYTES = 4 << 30
MAX_TRAINING_IMAGE_PIXELS = 50_000_000
# Fine-tuning jobs not yet ended (validating, queued or running) at once: one machine, one heavy job; a
# second one is refused with 429 until the first ends (image requests meanwhile: serve/jobs.Busy).
MAX_ACTIVE_TRAINING_JOBS = 1
