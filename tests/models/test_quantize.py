"""4/8-bit quantization: the predicate and record, rebuilding the quantized skeleton for a strict
load, and convert --quantize / quantize on the tiny snapshot.

The judge for quantized outputs is the same model with MLX's own dequantized weights
(`mx.dequantize`): the quantized kernels must reproduce it to float rounding. The distance to the
unquantized float32 model is the quantization error itself, bounded loosely and reported."""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from refs import load_folder_component, rel_err
from test_convert import leftovers, run_cli, text_encoder_outputs, transformer_outputs

from flux_klein_mlx.convert import convert_model
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.quantize import (
    apply_quantization,
    dequantize_model,
    quantize_model,
)
from flux_klein_mlx.run.loading import COMPONENTS
from flux_klein_mlx.run.loading import read_mlx_config as read_config
from flux_klein_mlx.storage.weights import load_into, read_safetensors, read_weight_files, save_safetensors_sharded


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(128, 64)  # quantized at g64 (and g32, g128)
        self.b = [nn.Linear(64, 48, bias=False), nn.ReLU(), nn.Linear(48, 64)]  # b.0 yes, b.2 (in 48) no
        self.emb = nn.Embedding(10, 128)  # not a Linear: stays
        self.conv = nn.Conv2d(3, 64, 3)  # stays

    def __call__(self, x):
        h = self.a(x)
        for layer in self.b:
            h = layer(h)
        return h


def toy(seed=0) -> Toy:
    mx.random.seed(seed)
    m = Toy()
    mx.eval(m.parameters())
    return m


def test_predicate_and_record():
    m = toy()
    record = quantize_model(m, 4)
    assert record == {"bits": 4, "group_size": 64, "mode": "affine", "layers": ["a", "b.0"]}
    assert isinstance(m.a, nn.QuantizedLinear) and isinstance(m.b[0], nn.QuantizedLinear)
    assert type(m.b[2]) is nn.Linear and type(m.emb) is nn.Embedding and type(m.conv) is nn.Conv2d
    json.dumps(record)  # JSON-able
    assert quantize_model(toy(), 8, group_size=128)["layers"] == ["a"]
    with pytest.raises(FluxKleinError, match="already quantized"):
        quantize_model(m, 8)


@pytest.mark.parametrize(
    "bits, group_size, message",
    [(3, 64, "cannot quantize to 3 bits; choose 4 or 8"), (2, 64, "choose 4 or 8"), (4, 48, "group size 48")],
)
def test_unsupported_settings(bits, group_size, message):
    with pytest.raises(FluxKleinError, match=message):
        quantize_model(toy(), bits, group_size)


@pytest.mark.parametrize("bits", [4, 8])
def test_record_rebuilds_skeleton_for_strict_load(tmp_path, bits):
    """Save a quantized model, rebuild a fresh one from the record, load strictly: identical outputs."""
    a = toy(0)
    record = quantize_model(a, bits)
    save_safetensors_sharded(dict(tree_flatten(a.parameters())), tmp_path, prefix="toy")
    stored = read_safetensors(tmp_path / "toy.safetensors")
    assert stored["a.weight"].dtype == mx.uint32 and "a.scales" in stored and "a.biases" in stored

    b = toy(1)  # different random init: everything must come from the file
    with pytest.raises(FluxKleinError, match="do not match"):
        load_into(b, stored, "toy")  # the unquantized skeleton does not take quantized tensors
    apply_quantization(b, json.loads(json.dumps(record)))
    load_into(b, stored, "toy")
    x = mx.random.normal((5, 128))
    assert mx.array_equal(a(x), b(x)).item()

    bad = dict(record, layers=record["layers"] + ["nope"])
    with pytest.raises(FluxKleinError, match="does not have"):
        apply_quantization(toy(), bad)
    with pytest.raises(FluxKleinError, match="damaged"):
        apply_quantization(toy(), {"bits": 4})


def test_quantized_equals_dequantized_weights():
    m = toy()
    quantize_model(m, 4)
    ref = dequantize_model(copy.deepcopy(m))
    assert all(not isinstance(x, nn.QuantizedLinear) for _, x in ref.named_modules())
    x = mx.random.normal((7, 128))
    assert rel_err(m(x), ref(x)) < 1e-5


# --- the tiny snapshot -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(snapshot, tmp_path_factory):
    """float32 conversions: unquantized, and quantized directly by convert at 4 and 8 bits."""
    root = tmp_path_factory.mktemp("q")
    out = {None: root / "f32", 4: root / "q4", 8: root / "q8"}
    for bits, path in out.items():
        convert_model(snapshot, path, dtype="float32", bits=bits)
    return out


def expected_layers(model: nn.Module, group_size=64) -> list[str]:
    return sorted(
        p for p, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.shape[1] % group_size == 0
    )


# Bounds: weight RMS error is ~(range of 64 Gaussians / (2^b - 1)) / sqrt(12): ~9 % at 4 bits, ~0.6 % at 8.
# Output errors are larger for the 27-layer random text encoder, which amplifies perturbations ~6x
# (measured: 8-bit 3e-2, 4-bit 0.46; transformer 8.5e-3 / 8.7e-2); trained models are far tamer.
@pytest.mark.parametrize("bits, weight_bound, bound", [(8, 0.01, 0.1), (4, 0.15, 0.7)])
def test_convert_quantize_load(folders, snapshot, bits, weight_bound, bound):
    from diffusers import Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    config = read_config(folders[bits])
    f32 = {n: load_folder_component(folders[None], n) for n in ("transformer", "text_encoder")}
    # The record names exactly the Linears whose input width is a multiple of 64.
    for name, model in f32.items():
        record = config[name]["quantization"]
        assert record["bits"] == bits and record["group_size"] == 64 and record["mode"] == "affine"
        assert record["layers"] == expected_layers(model) and record["layers"], name
    assert "double_blocks.0.img_attn.qkv" in config["transformer"]["quantization"]["layers"]
    assert "img_in" not in config["transformer"]["quantization"]["layers"]  # input width 32
    assert "txt_in" not in config["transformer"]["quantization"]["layers"]  # input width 96
    assert config["vae"]["quantization"] is None
    vae_q, vae_f = (read_safetensors(folders[k] / "vae.safetensors") for k in (bits, None))
    assert all(mx.array_equal(vae_q[k], vae_f[k]).item() for k in vae_f)  # the VAE is copied as it is

    transformer = load_folder_component(folders[bits], "transformer")
    assert isinstance(transformer.double_blocks[0].img_attn.qkv, nn.QuantizedLinear)
    text_encoder = load_folder_component(folders[bits], "text_encoder")
    refs = {
        "transformer": Flux2Transformer2DModel.from_pretrained(snapshot / "transformer").eval(),
        "text_encoder": Qwen3ForCausalLM.from_pretrained(snapshot / "text_encoder").eval(),
    }
    tok = folders[bits] / "tokenizer"
    run = {
        "transformer": lambda m: transformer_outputs(m, refs["transformer"]),
        "text_encoder": lambda m: text_encoder_outputs(m, refs["text_encoder"], tok),
    }
    for name, quantized in (("transformer", transformer), ("text_encoder", text_encoder)):
        ours, reference = run[name](quantized)
        deq_model = dequantize_model(copy.deepcopy(quantized))
        dequantized, _ = run[name](deq_model)
        # Weight error: RMS(dequantized - float32) / RMS(float32) over the quantized layers.
        orig, deq = dict(tree_flatten(f32[name].parameters())), dict(tree_flatten(deq_model.parameters()))
        layers = [f"{p}.weight" for p in config[name]["quantization"]["layers"]]
        diff = sum(((deq[k] - orig[k]) ** 2).sum().item() for k in layers)
        weight_err = (diff / sum((orig[k] ** 2).sum().item() for k in layers)) ** 0.5
        unquantized, _ = run[name](f32[name])
        kernel_err = rel_err(ours, dequantized)  # quantized kernels vs MLX's dequantized weights
        quant_err = rel_err(ours, reference)  # vs the float32 reference
        print(
            f"{bits}-bit {name}: weights {weight_err:.1e}, output vs dequantized {kernel_err:.1e}, "
            f"vs float32 {quant_err:.1e}"
        )
        assert kernel_err < 1e-5, (name, kernel_err)
        assert weight_err < weight_bound, (name, weight_err)
        assert rel_err(unquantized, reference) < 1e-4
        assert quant_err < bound, (name, quant_err)


def test_quantize_command_matches_convert_quantize(capsys, folders, tmp_path):
    out = tmp_path / "q4"
    code, stdout, err = run_cli(capsys, "quantize", "--model", str(folders[None]), "--bits", "4", "--output", str(out))
    assert code == 0, err
    assert "4-bit" in stdout
    a, b = read_config(out), read_config(folders[4])
    for name in COMPONENTS:
        assert a[name]["quantization"] == b[name]["quantization"]
        x = read_weight_files(sorted(out.glob(f"{name}*.safetensors")))
        y = read_weight_files(sorted(folders[4].glob(f"{name}*.safetensors")))
        assert x.keys() == y.keys() and all(mx.array_equal(x[k], y[k]).item() for k in x), name
    assert a["source"]["format"] == "flux_klein_mlx" and a["source"]["original"]["format"] == "diffusers"
    assert a["is_distilled"] is True and a["dtype"] == "float32"
    assert leftovers(out) == []


def test_quantize_command_bad_input(capsys, folders, snapshot, tmp_path):
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, "quantize", "-m", str(folders[4]), "-b", "8", "-o", str(out))
    assert code == 1 and err.count("\n") == 1 and "already quantized to 4 bits" in err
    code, _, err = run_cli(capsys, "quantize", "-m", str(folders[None]), "-b", "3", "-o", str(out))
    assert code == 1 and err.count("\n") == 1 and "cannot quantize to 3 bits; choose 4 or 8" in err
    code, _, err = run_cli(capsys, "quantize", "-m", str(snapshot), "-b", "4", "-o", str(out))
    assert code == 1 and "convert it first" in err
    code, _, err = run_cli(capsys, "quantize", "-m", str(folders[None]), "-b", "4", "-o", str(folders[4]))
    assert code == 1 and "already exists; pass --overwrite" in err
    assert not out.exists() and leftovers(out) == []


def test_quantize_at_load_equals_prequantized(folders):
    """`load(..., quantize=4)` on an unquantized folder gives the same tensors as the 4-bit folder."""
    for name in ("transformer", "text_encoder"):
        at_load = dict(tree_flatten(load_folder_component(folders[None], name, quantize=4).parameters()))
        stored = dict(tree_flatten(load_folder_component(folders[4], name).parameters()))
        assert at_load.keys() == stored.keys()
        assert all(mx.array_equal(at_load[k], stored[k]).item() for k in stored), name
    vae = load_folder_component(folders[None], "vae", quantize=4)  # the VAE stays unquantized
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in vae.named_modules())
