"""Peak memory of `generate --upsample --quantize 4` at 1024²: FLUX 3's prompt upsampler, released, then FLUX 3.

A run does what that command does, through the package's own code: `pipe.inputs(..., upsample=True)` (what
`cli.caption_first` calls) writes the caption with `upsample.runtime.Upsampler` (mlx-vlm's load of the
folder, our request and greedy decoding, the release), then the pipeline's stages run on the caption
(`flux3_memory.run_image`: text encoder, transformer, VAE, each made just before its stage). The upsampler
is black-forest-labs/flux-3-image-klein-pup's architecture at full size (Qwen3.5-9B: the language model of
transformers' `Qwen3_5TextConfig` defaults, which are the 9B's, 8.95 B parameters with untied embeddings,
and a 27-layer vision tower, 18.8 GB in bf16 as the hub's) with random weights, written as `convert
--quantize 4` writes it (mlx-vlm's layout, the vision tower left in bf16 as mlx-vlm's convert leaves it): the
module's lazily made random values, quantized and written shard by shard, never whole in bf16. It lives in
a temporary folder (`--work`), deleted at the end. The chat template, tokenizer (the real Qwen3 one: its
vision tokens are the config's ids) and image processor settings are those of tests/support/tiny_pup.py.
FLUX 3 is `random_pipeline` of `FLUX3_VARIANTS["flux3-klein"]` at 4 bits, as in flux3_memory.py.

Matmuls, attention with a fused kernel, norms and convolutions are memory.py's stand-ins with the Metal
kernels' memory profile (its docstring says why): a 9B prefill and thousands of decode steps in real compute
take hours on this CPU. Qwen3.5's attention layers (head dim 256) run as they are: MLX's Metal backend sends a
prefill of that head dim to its unfused path too (scores materialised). The DeltaNet prefill has the memory
profile of mlx-vlm's Metal kernel (`emulate_deltanet_kernel`, rows "kernel"), or runs as mlx-vlm runs it off
Metal, a chunked scan whose products with batch axes are computed as they are (rows "chunked"). With
the stand-ins the greedy answer is one token repeated, never the stop token: a run writes exactly the number
of new tokens it is given, so the 3584-token ceiling is measured, not extrapolated. The stage's seconds are
this CPU's with the stand-ins (no speed of a Mac).

    .venv/bin/python benchmarks/upsample_memory.py run --work /tmp/pup-bench   # the plan (~6 GB of disk, deleted)
    .venv/bin/python benchmarks/upsample_memory.py report                      # markdown table of the JSON
    .venv/bin/python benchmarks/upsample_memory.py one --tokens 48 --mode i2i  # one row, printed (--save: kept)
    .venv/bin/python benchmarks/upsample_memory.py one --mode i2i --tokens 4 --depth 4 --parts  # where it goes
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, flux3_memory.py, memory.py
import common  # noqa: E402, F401  (first: this checkout on sys.path, OpenBLAS bound before mlx loads)

# isort: split
import mlx.core as mx  # noqa: E402
from common import GB, ROOT, folder_bytes, max_rss_bytes, run_json_child  # noqa: E402
from pup_files import write_hub_files  # noqa: E402

RESULTS = ROOT / "benchmarks" / "upsample_memory.json"
PROMPT = "a red fox in fresh snow at dawn"  # a short prompt, what --upsample is for
MAX_NEW_TOKENS = 3584  # diffusers' cap on a caption (upsample/request.py)
FLUX3_TEMPLATE_TOKENS = 9  # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n around FLUX 3's prompt
# (mode, new tokens, FLUX 3 after it, DeltaNet prefill): the edit's upsampler (the vision tower on a 1 MP
# reference) with a bounded answer; the whole t2i run with the caption at the ceiling; both prefills again with
# the DeltaNet's Metal kernel's profile (`emulate_deltanet_kernel`) instead of mlx-vlm's CPU scan.
PLAN = [
    ("i2i", 48, False, "chunked"),
    ("t2i", MAX_NEW_TOKENS, True, "chunked"),
    ("i2i", 48, False, "kernel"),
    ("t2i", 48, False, "kernel"),
]


# --- the random upsampler folder ---------------------------------------------------------------------


def lazy_upsampler(folder: Path):
    """(model, config) of mlx-vlm for the folder's config.json, built lazily: no value is made yet."""
    from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs

    config = load_config(folder)
    model_class, _ = get_model_and_args(config=config, model_path=folder)
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, model_class, config, ["text", "vision"])
    return model_class.Model(model_config), config


ROW_BLOCK = 8192  # rows of a quantized matrix drawn at a time (the 248320-row embedding: 31 blocks)


def random_quantized(module, dtype, key) -> None:
    """A quantized layer's weights as N(0, 1/fan_in) values quantized, drawn and quantized ROW_BLOCK rows at a
    time (groups run along a row, so blocks quantize as the whole would): no unquantized copy of the matrix."""
    rows, cols = module.weight.shape[0], module.weight.shape[1] * 32 // module.bits
    keys = mx.random.split(key, -(-rows // ROW_BLOCK))
    parts = []
    for i, start in enumerate(range(0, rows, ROW_BLOCK)):
        w = mx.random.normal((min(ROW_BLOCK, rows - start), cols), dtype=dtype, key=keys[i]) * cols**-0.5
        parts.append(mx.quantize(w, module.group_size, module.bits))
    module.weight, module.scales, module.biases = (mx.concatenate([p[j] for p in parts]) for j in range(3))


def randomize(model, dtype) -> None:
    """Random values for a lazily built, quantized model, all still lazy: quantized layers by `random_quantized`,
    other matrices (the vision tower's, in bf16) N(0, 1/fan_in) in `dtype`; vectors keep the module's own values
    (norm scales, the DeltaNet's A_log and dt_bias), cast as convert casts them (A_log stays float32)."""
    import math

    from mlx.utils import tree_flatten, tree_map_with_path

    cast = model.cast_predicate
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    for i, (_, module) in enumerate(model.named_modules()):
        if hasattr(module, "scales"):
            random_quantized(module, dtype, mx.random.key(i))
    new = []
    for i, (name, v) in enumerate(tree_flatten(model.parameters())):
        if v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating) and not name.endswith((".scales", ".biases")):
            new.append(
                (name, mx.random.normal(v.shape, dtype=dtype, key=mx.random.key(i)) * math.prod(v.shape[1:]) ** -0.5)
            )
    model.load_weights(new, strict=False)


def write_random_upsampler(
    folder: Path, bits: int, group_size: int = 64, text_layers: int | None = None, vision_depth: int | None = None
) -> dict:
    """The upsampler as `convert --quantize BITS` writes it (mlx-vlm's quantize_model with convert's predicate:
    the vision tower stays bf16), values random; shards of 1 GB made and written one at a time."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_vlm.quant_utils import quantize_model
    from mlx_vlm.utils import make_shards, save_config, skip_multimodal_module

    t0 = time.perf_counter()
    write_hub_files(folder, text_layers, vision_depth)
    model, config = lazy_upsampler(folder)
    bf16_bytes = sum(v.size * 2 for _, v in tree_flatten(model.parameters()))
    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))

    def predicate(path, module):  # mlx-vlm convert's own, for a model without a predicate of its own
        return not skip_multimodal_module(path)

    model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    randomize(model, mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))  # the shards hold the only references
    shards = make_shards(weights, max_file_size_gb=1)
    weights.clear()
    index = {"metadata": {}, "weight_map": {}}
    for i in range(len(shards)):
        shard, shards[i] = shards[i], None
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        index["weight_map"].update(dict.fromkeys(shard, name))
        del shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    save_config(config, config_path=folder / "config.json")
    return {
        "parameters": parameters,
        "bf16_bytes": bf16_bytes,
        "folder_bytes": folder_bytes(folder),
        "making_peak": mx.get_peak_memory(),
        "making_seconds": time.perf_counter() - t0,
    }


def state_bytes(config: dict, tokens: int) -> dict:
    """What the upsampler's cache holds after `tokens` tokens, from its config: the attention layers' keys and
    values grow with each token (bf16), the DeltaNet layers' state does not (a conv window of the kernel's
    last steps in bf16, a float32 matrix per value head)."""
    t = config["text_config"]
    layers = t["num_hidden_layers"]
    attention = t["layer_types"].count("full_attention")  # every 4th layer
    per_token = attention * 2 * t["num_key_value_heads"] * t["head_dim"] * 2
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    conv_dim = 2 * key_dim + t["linear_num_value_heads"] * t["linear_value_head_dim"]
    linear = (layers - attention) * (
        (t["linear_conv_kernel_dim"] - 1) * conv_dim * 2
        + t["linear_num_value_heads"] * t["linear_value_head_dim"] * t["linear_key_head_dim"] * 4
    )
    return {"kv_bytes_per_token": per_token, "kv_bytes": per_token * tokens, "linear_state_bytes": linear}


# --- one run -------------------------------------------------------------------------------------------


def watch_generation(record: dict) -> None:
    """Wrap mlx-vlm's stream_generate (the Upsampler calls it by name at each caption) to note what the stage
    holds when it starts (the loaded weights), after the first token (the prefill) and at the end."""
    import importlib

    module = importlib.import_module("mlx_vlm.generate")  # (the package's `generate` attribute is a function)
    generate = module.stream_generate

    def watched(*args, **kwargs):
        record["loaded_active"] = mx.get_active_memory()
        record["load_peak"] = mx.get_peak_memory()
        last = None
        for last in generate(*args, **kwargs):
            if "prefill_peak" not in record:
                record["prefill_peak"] = mx.get_peak_memory()
            yield last
        record.update(
            prompt_tokens=last.prompt_tokens,
            new_tokens=last.generation_tokens,
            prompt_tps=last.prompt_tps,
            generation_tps=last.generation_tps,
        )

    module.stream_generate = watched


def emulate_deltanet_kernel() -> None:
    """Give the gated-DeltaNet prefill the memory profile of mlx-vlm's Metal kernel (`gated_delta_kernel`: one op
    that reads q, k, v, the gates and the state and writes the output and the new state). Off Metal mlx-vlm runs a
    chunked scan instead, whose float32 chunk matrices and triangular solve hold ~0.6 GB per layer at 1620 tokens
    (`one --parts`), which a Mac never allocates. Same inputs and output shapes, meaningless values."""
    from mlx_vlm.models.qwen3_5 import gated_delta

    def kernel_stand_in(q, k, v, g, beta, state, mask=None, **kw):
        extra = q.sum() + k.sum() + g.sum() + beta.sum()
        return v + extra.astype(v.dtype), state + extra.astype(state.dtype)

    gated_delta.gated_delta_chunked = kernel_stand_in


def watch_parts(record: dict) -> None:
    """Where the prefill's memory goes (`one --parts`): the vision tower and each text layer are evaluated on their
    own (mlx-vlm's classes wrapped), each noting its peak above what was held before it. Evaluating part by part
    changes MLX's schedule a little: these rows attribute the stage's peak, the stage's own run measures it."""
    from mlx_vlm.models.qwen3_5.language import Qwen3_5DecoderLayer
    from mlx_vlm.models.qwen3_5.vision import VisionModel

    def watched(cls, name):
        call = cls.__call__

        def part(self, x, *args, **kwargs):
            mx.eval(x)
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            out = call(self, x, *args, **kwargs)
            mx.eval(out)
            key = name(self, x)
            record.setdefault(key, 0)
            record[key] = max(record[key], mx.get_peak_memory() - before)
            return out

        cls.__call__ = part

    def layer_name(self, x):
        kind = "DeltaNet" if self.is_linear else "attention"
        return f"{kind} layer, {x.shape[1]} tokens"

    watched(VisionModel, lambda self, x: f"vision tower, {x.shape[0]} patches")
    watched(Qwen3_5DecoderLayer, layer_name)


def reference_image(size: int):
    """A 1 MP photograph-like reference: smooth colour fields plus noise (its content does not change memory)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, 1 - x * y], -1) * 200 + rng.normal(0, 20, (size, size, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def upsample_stage(pipe, folder: Path, mode: str, tokens: int, size: int) -> tuple[object, dict]:
    """The caption, as `generate --upsample` writes it: `pipe.inputs` with upsample=True (no caption cache: the
    random pipeline has none), the upsampler loaded, run and released there. The stage's peak and what it
    leaves behind."""
    from flux_klein_mlx.upsample.runtime import Upsampler

    record = {}
    watch_generation(record)
    pipe.upsampler = Upsampler(folder, max_new_tokens=tokens)
    settings = dict(width=size, height=size, steps=1, seed=0, upsample=True)
    if mode == "i2i":
        settings["images"] = [reference_image(1024)]
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    prepared = pipe.inputs(PROMPT, settings)
    record.update(
        upsample_peak=mx.get_peak_memory(),
        active_before=before,
        active_after=mx.get_active_memory(),  # the upsampler released: back to what was there before
        upsample_seconds=prepared.upsample_seconds,
        upsampler_load_seconds=pipe.upsampler.load_seconds,
        caption_chars=len(prepared.settings.prompt),
    )
    return prepared, record


def child(mode: str, tokens: int, flux3: bool, scan: str, size: int, bits: int, folder: str, parts=False) -> dict:
    """One run: the upsampler's stage, then (`flux3`) FLUX 3's stages on the caption, in one process. `scan`:
    "kernel" (the DeltaNet prefill with the Metal kernel's memory profile) or "chunked" (mlx-vlm's CPU scan)."""
    import flux3_memory

    from flux_klein_mlx.bench.random_model import random_pipeline
    from flux_klein_mlx.models.flux3.config import FLUX3_VARIANTS
    from flux_klein_mlx.upsample.runtime import PREFILL_CHUNK

    flux3_memory.stand_ins()
    # FLUX 3's random matrices are zeros (as flux3_memory.py's bf16 rows: memory does not depend on values), so the
    # stand-ins' meaningless values stay finite over a caption's 3600-token window (the text encoder's finite check
    # stops a run otherwise). The upsampler is read from its files: its values stay random.
    mx.random.normal = lambda shape, dtype=mx.float32, key=None, **kw: mx.zeros(shape, dtype)
    if scan == "kernel":
        emulate_deltanet_kernel()
    folder = Path(folder)
    transients = {}
    if parts:
        watch_parts(transients)
    row = FLUX3_VARIANTS["flux3-klein"]
    # FLUX 3 reads the caption the upsampler wrote: a window for that many tokens and its chat template.
    caption_tokens = tokens + FLUX3_TEMPLATE_TOKENS
    pipe = random_pipeline(row, dtype=mx.bfloat16, quantize=bits, prompt_tokens=caption_tokens)
    prepared, record = upsample_stage(pipe, folder, mode, tokens, size)
    print(json.dumps(record), file=sys.stderr, flush=True)  # the stage's figures, shown if a later stage fails
    config = json.loads((folder / "config.json").read_text())
    out = {
        "mode": mode,
        "deltanet_prefill": scan,
        "prefill_chunk": PREFILL_CHUNK,  # tokens per prefill pass (upsample/runtime)
        "size": size,
        "bits": bits,
        "max_new_tokens": tokens,
        **record,
        "upsampler_weights": folder_bytes(folder),
        "upsampler_layers": config["text_config"]["num_hidden_layers"],
        "vision_depth": config["vision_config"]["depth"],
        **state_bytes(config, record["prompt_tokens"] + record["new_tokens"]),
    }
    if flux3:
        made = {}
        image = flux3_memory.run_image(pipe, made, True, prepared)
        flux = flux3_memory.run_row(pipe, image, "flux3-klein", size, "bfloat16", bits, False, None, made)
        out.update({k: flux[k] for k in ("text_tokens", "encode_peak", "denoise_peak", "decode_peak", "weights")})
        out.update(making_peak=made, step_seconds=flux["step_seconds"], flux3_seconds=image["seconds"])
        out["stats_line"] = stats_line(image["job"].stats)
    if parts:
        out["parts"] = transients
    out["peak"] = max(out.get(k, 0) for k in ("upsample_peak", "encode_peak", "denoise_peak", "decode_peak"))
    out["max_rss"] = max_rss_bytes()
    return out


def stats_line(stats) -> str:
    """The line `generate` prints for the image (its `summary`), the upsample stage first."""
    from flux_klein_mlx.generate import summary

    return summary(stats, 0, 0, 1)


# --- the plan, the table -------------------------------------------------------------------------------


def run_child(**job) -> dict:
    row = run_json_child([sys.executable, __file__, "--child", json.dumps(job)], f"upsample memory {job}")
    print(format_row(row), flush=True)
    return row


SCANS = {"kernel": "Metal kernel's profile", "chunked": "mlx-vlm's CPU scan"}


def format_row(r: dict) -> str:
    flux = (
        f", encode {r['encode_peak'] / GB:.2f} GB, denoise {r['denoise_peak'] / GB:.2f} GB, "
        f"decode {r['decode_peak'] / GB:.2f} GB"
        if "encode_peak" in r
        else ""
    )
    return (
        f"{r['mode']} {r['size']}² --quantize {r['bits']} ({SCANS[r['deltanet_prefill']]}): "
        f"upsample {r['upsample_peak'] / GB:.2f} GB "
        f"({r['prompt_tokens']} + {r['new_tokens']} tokens, {r['upsample_seconds']:.0f} s){flux}, "
        f"peak {r['peak'] / GB:.2f} GB"
    )


def report(results: dict) -> str:
    """The markdown table of benchmarks/MEMORY.md (section 6)."""
    lines = [
        "| `--upsample --quantize 4`, 1024², one step | DeltaNet prefill | prefill pass | upsampler loaded | "
        "after the prefill | upsample | released to | encode | denoise | decode | peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("runs", []):
        flux = [f"{r[k] / GB:.2f} GB" if k in r else "-" for k in ("encode_peak", "denoise_peak", "decode_peak")]
        lines.append(
            f"| {r['mode']}, {r['prompt_tokens']} prompt + {r['new_tokens']} new tokens | "
            f"{SCANS[r['deltanet_prefill']]} | {r['prefill_chunk']} tokens | {r['load_peak'] / GB:.2f} GB | "
            f"{r['prefill_peak'] / GB:.2f} GB | "
            f"{r['upsample_peak'] / GB:.2f} GB | {r['active_after'] / 1e6:.0f} MB | {' | '.join(flux)} | "
            f"**{r['peak'] / GB:.2f} GB** |"
        )
    return "\n".join(lines)


def run_plan(work: Path, bits: int, size: int, plan=PLAN, depth=None, vision_depth=None, parts=False, folder=None):
    """Write the random upsampler (in a child: its making peak is its own) unless `folder` holds one, then one
    child per row; yields ("making", what the making took) first, then ("run", row) per row. A folder it wrote is
    deleted at the end."""
    made_here = folder is None
    folder = work / "pup-q4" if made_here else Path(folder)
    job = dict(folder=str(folder), bits=bits, depth=depth, vision_depth=vision_depth)
    try:
        if made_here:
            made = run_json_child([sys.executable, __file__, "--make", json.dumps(job)], "writing the random upsampler")
            print(f"random upsampler: {made['folder_bytes'] / GB:.2f} GB on disk, {made['making_seconds']:.0f} s")
            yield "making", made
        for mode, tokens, flux3, scan in plan:
            job = dict(mode=mode, tokens=tokens, flux3=flux3, scan=scan, size=size, bits=bits, folder=str(folder))
            yield "run", run_child(**job, parts=parts)
    finally:
        if made_here:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["run", "one", "report"], nargs="?", default="run")
    p.add_argument("--work", default=None, help="Folder for the random upsampler (default: a temporary one).")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--mode", choices=["t2i", "i2i"], default="t2i")
    p.add_argument("--tokens", type=int, default=48, help="New tokens of the caption (one).")
    p.add_argument("--flux3", action="store_true", help="FLUX 3's stages after the caption (one).")
    p.add_argument("--depth", type=int, default=None, help="Text layers instead of 32 (one: a quick check).")
    p.add_argument("--vision-depth", type=int, default=None, help="Vision layers instead of 27 (one).")
    p.add_argument("--scan", choices=["kernel", "chunked"], default="kernel", help="The DeltaNet prefill (one).")
    p.add_argument("--folder", default=None, help="A random upsampler written before (one): kept.")
    p.add_argument("--save", action="store_true", help="Add the row to the JSON (one).")
    p.add_argument("--parts", action="store_true", help="Each part's own peak too (one: where memory goes).")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--make", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        job = json.loads(args.make)
        made = write_random_upsampler(Path(job["folder"]), job["bits"], 64, job["depth"], job["vision_depth"])
        print(json.dumps(made))
        return
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
    if args.part == "report":
        print(report(results))
        return
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        plan = [(args.mode, args.tokens, args.flux3, args.scan)] if args.part == "one" else PLAN
        if args.part == "run":
            results = {"runs": [], "machine": {"mlx": mx.__version__, "platform": sys.platform}}
        for kind, row in run_plan(
            Path(work), args.bits, args.size, plan, args.depth, args.vision_depth, args.parts, args.folder
        ):
            if args.part == "one":
                print(json.dumps(row, indent=2))
                if not args.save or kind == "making":
                    continue
            if kind == "making":
                results["upsampler_making"] = row
            else:
                results["runs"].append(row)
            RESULTS.write_text(json.dumps(results, indent=2) + "\n")  # each row as it comes
    if args.part == "run":
        print(report(results))


if __name__ == "__main__":
    main()
