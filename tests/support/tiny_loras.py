"""Each family's LoRA files written by hand from one peft adapter, and diffusers' own LoRA loading as their judge,
for the LoRA tests written once for both families (tests/lora/test_lora_transformer.py; the kit's `lora`).

The adapter is made by peft on the family's tiny diffusers transformer (tests/support/tiny_transformers.py's
g64 models: LoraConfig on every Linear, rank 4, alpha 8, random B) and saved by diffusers (the family's
`LoraLoaderMixin.save_lora_weights`). The BFL and kohya files are the same adapter under BFL's names, written
here from the inverse of diffusers' tables, not ours: BFL `diffusion_model.<name>.lora_A/B.weight` with
alpha / rank folded into B (ComfyUI's convention: no alpha), kohya `lora_unet_<name, underscored>.lora_down/up`
+ `.alpha`; the final layer's up rows rolled from diffusers' [scale ; shift] to BFL's [shift ; scale]. FLUX.2's
BFL checkpoints fuse q, k and v: their three LoRAs become one of rank 3r on the fused layer (the downs stacked,
the ups block-diagonal), which is what diffusers' FLUX.2 converter splits back.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import torch
from safetensors.torch import save_file

RANK, ALPHA = 4, 8.0


class Rand:
    """Random LoRA factors: down ~ N(0, 1/in), up ~ N(0, 0.5^2/r), so updates are a fair share of the weights."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def pair(self, out, inp, r):
        down = torch.randn(r, inp, generator=self.g) / math.sqrt(inp)
        up = 0.5 * torch.randn(out, r, generator=self.g) / math.sqrt(r)
        return down, up

    def mat(self, *shape, s=1.0):
        return s * torch.randn(*shape, generator=self.g)


def swap_halves(x):
    h = x.shape[0] // 2
    return np.concatenate([x[h:], x[:h]], axis=0)


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def peft_adapter(reference, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A random LoRA on every Linear made by peft on a copy of the reference: (diffusers' state dict, its config)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(reference)
    torch.manual_seed(seed)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=linear_names(model), init_lora_weights=False)
    model.add_adapter(config)
    with torch.no_grad():  # peft's B is random with init_lora_weights=False; make A and B O(1/sqrt(fan_in))
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    return get_peft_model_state_dict(model), config.to_dict()


def pairs(sd) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """diffusers module -> (down, up) of a peft state dict."""
    out = {}
    for key, value in sd.items():
        name, role = key.rsplit(".lora_", 1)
        down, up = out.get(name, (None, None))
        out[name] = (value, up) if role.startswith("A") else (down, value)
    return out


def roll_final(name: str, up: torch.Tensor) -> torch.Tensor:
    """diffusers' norm_out rows [scale ; shift] -> BFL's [shift ; scale]."""
    return torch.roll(up, up.shape[0] // 2, 0) if name == "norm_out.linear" else up


# Which file diffusers loads to judge each of our files of one adapter (tests/lora/test_lora_transformer.py and
# test_lora_pipeline.py): it reads diffusers/PEFT files and BFL block names itself. kohya names and BFL's non-block
# names (time_in, final_layer, ...) it does not convert for FLUX 3 (`_convert_non_diffusers_flux3_lora_to_diffusers`
# maps only block linears; FLUX 3 has no kohya converter), and FLUX.2's converter swaps no halves of the final
# layer and drops kohya's modulation layers: those are judged against diffusers with the diffusers file of the
# same adapter. A LoKr ("lokr") is judged by its dense twin (`save_dense_twin`): diffusers' FLUX 3 loader takes no
# LoKr at all (`load_lora_weights` refuses keys without "lora"), and FLUX.2's reads one naming at a time.
JUDGE = {"diffusers": "diffusers", "bfl-blocks": "bfl-blocks", "bfl": "diffusers", "bfl-model-prefix": "diffusers",
         "kohya": "diffusers", "lokr": "lokr-twin"}  # fmt: skip


def save_dense_twin(path, deltas: dict[str, np.ndarray]) -> str:
    """A PEFT file whose update on each diffusers module is `deltas[module]` exactly: down = I (in x in), up = the
    delta, no alpha (diffusers then takes alpha = rank per module: scale 1). The judge of a LoKr's whole update."""
    out = {}
    for name, delta in deltas.items():
        out[f"transformer.{name}.lora_A.weight"] = torch.eye(delta.shape[1])
        out[f"transformer.{name}.lora_B.weight"] = torch.from_numpy(np.ascontiguousarray(delta, np.float32))
    save_file(out, str(path))
    return str(path)


class Flux2Loras:
    mixin = "Flux2LoraLoaderMixin"
    variants = ("g64",)  # tests/support/tiny_transformers.py's models
    seed = 3
    # diffusers' FLUX.2 converter reads every BFL name (the final layer without the half swap: its known bug),
    # so a comfyui file's image in diffusers has no block-only twin
    comfyui_judge = None
    kohya_converter = "_convert_kohya_flux2_lora_to_diffusers"  # diffusers' reader of kohya names (lora_unet_)
    released = "klein_4b"  # the params of a released model of this family (FluxKleinParams.klein_4b())
    # a module of this family's files at the released size (BFL names, D = 3072), for the other family's model
    foreign = {"diffusion_model.double_blocks.0.img_attn.proj": (3072, 3072)}
    _DOUBLE = {
        "attn.to_out.0": "img_attn.proj",
        "attn.to_add_out": "txt_attn.proj",
        "ff.linear_in": "img_mlp.0",
        "ff.linear_out": "img_mlp.2",
        "ff_context.linear_in": "txt_mlp.0",
        "ff_context.linear_out": "txt_mlp.2",
    }
    _QKV = {
        "attn.to_q": ("img_attn.qkv", 0),
        "attn.to_k": ("img_attn.qkv", 1),
        "attn.to_v": ("img_attn.qkv", 2),
        "attn.add_q_proj": ("txt_attn.qkv", 0),
        "attn.add_k_proj": ("txt_attn.qkv", 1),
        "attn.add_v_proj": ("txt_attn.qkv", 2),
    }
    _SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
    _GLOBAL = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
               "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
               "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
               "norm_out.linear": "final_layer.adaLN_modulation.1",
               "single_stream_modulation.linear": "single_stream_modulation.lin",
               "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
               "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin"}  # fmt: skip

    def bfl(self, sd) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """BFL module -> (down, up), q/k/v fused, final rows rolled, alpha / rank still apart."""
        out, fused = {}, {}
        for name, (down, up) in pairs(sd).items():
            m = re.fullmatch(r"(single_)?transformer_blocks\.(\d+)\.(.+)", name)
            if m is None:
                out[self._GLOBAL[name]] = (down, roll_final(name, up))
            elif m.group(1):
                out[f"single_blocks.{m.group(2)}.{self._SINGLE[m.group(3)]}"] = (down, up)
            elif m.group(3) in self._QKV:
                layer, part = self._QKV[m.group(3)]
                fused.setdefault(f"double_blocks.{m.group(2)}.{layer}", [None] * 3)[part] = (down, up)
            else:
                out[f"double_blocks.{m.group(2)}.{self._DOUBLE[m.group(3)]}"] = (down, up)
        for layer, parts in fused.items():
            out[layer] = (torch.cat([d for d, _ in parts]), torch.block_diag(*(u for _, u in parts)))
        return out

    def judge_pipeline(self, snapshot):
        """diffusers' Flux2KleinPipeline of the snapshot (distilled or Base, by its model_index.json) with a
        transformer of its own (LoRAs load into it)."""
        import json
        from pathlib import Path

        from refs import diffusers_pipeline_for_loras

        index = json.loads((Path(snapshot) / "model_index.json").read_text())
        return diffusers_pipeline_for_loras(snapshot, distilled=index.get("is_distilled", False))

    def judge_image(self, pipe, snapshot, *, prompt, latents, steps) -> np.ndarray:
        """diffusers' image of `pipe` as it is (its LoRAs loaded), from injected latents, its size the latents'
        (Base: its default guidance 4 and negative prompt "", as ours)."""
        from refs import diffusers_image, diffusers_prompt_embeds

        embeds = diffusers_prompt_embeds(pipe, prompt)
        return diffusers_image(pipe, embeds, latents, 16 * latents.shape[2], steps)

    def diffusers_deltas(self, deltas, reference=None) -> dict[str, np.ndarray]:
        """Our layer -> update (our rows) to diffusers module -> update (its rows): fused q/k/v split in three,
        the final layer's halves rolled back to [scale ; shift]; all-zero parts left out."""
        layers = {v: k for k, v in {**self._GLOBAL}.items()}
        inverse = {v: k for k, v in {**self._DOUBLE, **self._SINGLE}.items()}
        out = {}
        for layer, delta in deltas.items():
            m = re.fullmatch(r"(double|single)_blocks\.(\d+)\.(.+)", layer)
            if m is None:
                name = layers[layer]
                out[name] = np.roll(delta, delta.shape[0] // 2, 0) if name == "norm_out.linear" else delta
            elif m.group(1) == "single":
                out[f"single_transformer_blocks.{m.group(2)}.{inverse[m.group(3)]}"] = delta
            elif m.group(3).endswith("attn.qkv"):
                rows = delta.shape[0] // 3
                for name, (fused, part) in self._QKV.items():
                    if fused == m.group(3) and np.any(delta[part * rows : (part + 1) * rows]):
                        out[f"transformer_blocks.{m.group(2)}.{name}"] = delta[part * rows : (part + 1) * rows]
            else:
                out[f"transformer_blocks.{m.group(2)}.{inverse[m.group(3)]}"] = delta
        return out

    def lokr(self, path, rng, params) -> dict[str, np.ndarray]:
        """LyCORIS LoKr in three namings (BFL, diffusers', LyCORIS' underscored), whole and factorised factors, on
        rows of the fused qkv and linear1 and the final layer (halves swapped); returns {our layer: delta} from
        numpy. Sizes: hidden 64, MLP 192 (the tiny snapshot's and the g64 model's)."""
        from flux_klein_mlx.models.flux2.transformer import linear_shapes

        D, M = params.hidden_size, params.mlp_hidden
        assert (D, M) == (64, 192), (D, M)
        sd, expected = {}, {}

        def add(layer, rows, delta):
            full = expected.setdefault(layer, np.zeros(linear_shapes(params)[layer], np.float32))
            full[rows[0] : rows[1]] += delta

        w1, w2 = rng.mat(4, 4), rng.mat(48, 16, s=0.1)  # whole factors: no alpha scaling even with an alpha key
        sd |= {
            "double_blocks.0.img_attn.qkv.lokr_w1": w1,
            "double_blocks.0.img_attn.qkv.lokr_w2": w2,
            "double_blocks.0.img_attn.qkv.alpha": torch.tensor(2.0),
        }
        add("double_blocks.0.img_attn.qkv", (0, 3 * D), np.kron(w1.numpy(), w2.numpy()))
        a, b, w2 = rng.mat(8, 2), rng.mat(2, 8), rng.mat(72, 8, s=0.1)  # w1 = a @ b, rank 2, alpha 4 -> x2
        sd |= {
            "single_blocks.0.linear1.lokr_w1_a": a,
            "single_blocks.0.linear1.lokr_w1_b": b,
            "single_blocks.0.linear1.lokr_w2": w2,
            "single_blocks.0.linear1.alpha": torch.tensor(4.0),
        }
        add("single_blocks.0.linear1", (0, 3 * D + 2 * M), 2.0 * np.kron((a @ b).numpy(), w2.numpy()))
        w1, w2 = rng.mat(2, 4), rng.mat(32, 16, s=0.1)  # diffusers' to_k: rows D..2D of our fused qkv
        sd |= {"transformer_blocks.1.attn.to_k.lokr_w1": w1, "transformer_blocks.1.attn.to_k.lokr_w2": w2}
        add("double_blocks.1.img_attn.qkv", (D, 2 * D), np.kron(w1.numpy(), w2.numpy()))
        w1, w2 = rng.mat(2, 2), rng.mat(64, 32, s=0.1)  # diffusers' norm_out: [scale; shift] -> ours [shift; scale]
        sd |= {"norm_out.linear.lokr_w1": w1, "norm_out.linear.lokr_w2": w2}
        add("final_layer.adaLN_modulation.1", (0, 2 * D), swap_halves(np.kron(w1.numpy(), w2.numpy())))
        w1, a, b = rng.mat(4, 8), rng.mat(16, 3, s=0.3), rng.mat(3, 32, s=0.3)  # w2 = a @ b, rank 3, alpha 1.5
        name = "lycoris_single_transformer_blocks_1_attn_to_out"
        sd |= {
            f"{name}.lokr_w1": w1,
            f"{name}.lokr_w2_a": a,
            f"{name}.lokr_w2_b": b,
            f"{name}.alpha": torch.tensor(1.5),
        }
        add("single_blocks.1.linear2", (0, D), 0.5 * np.kron(w1.numpy(), (a @ b).numpy()))
        save_file(sd, str(path))
        return expected


class Flux3Loras:
    mixin = "Flux3LoraLoaderMixin"
    variants = ("g64-fm0", "g64-fm1")
    seed = 3
    # diffusers' FLUX 3 converter maps only block linears (`_convert_non_diffusers_flux3_lora_to_diffusers`): a
    # comfyui file reads there as the block-only BFL file of the same adapter
    comfyui_judge = "bfl-blocks"
    kohya_converter = None  # diffusers 0.42.1 reads no kohya FLUX 3 names
    released = None  # Flux3Params(): the released size
    foreign = {"diffusion_model.content_mode_blocks.image.1.q_proj": (3072, 3072)}

    def bfl(self, sd) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        from flux_klein_mlx.models.flux3.transformer import flux3_name

        return {flux3_name(name): (down, roll_final(name, up)) for name, (down, up) in pairs(sd).items()}

    def judge_pipeline(self, snapshot):
        """diffusers' FLUX 3 modular pipeline of the snapshot (the session's: a test unloads what it loads)."""
        from flux3_refs import flux3_pipeline

        return flux3_pipeline(snapshot)

    def judge_image(self, pipe, snapshot, *, prompt, latents, steps) -> np.ndarray:
        from flux3_refs import flux3_reference

        return flux3_reference(snapshot, prompt=prompt, latents=latents, steps=steps)

    def diffusers_deltas(self, deltas, reference) -> dict[str, np.ndarray]:
        """Our layer -> update (our rows) to diffusers module -> update: one module per layer (names from the
        reference's Linears through flux3_name), the final layer's halves rolled back to [scale ; shift]."""
        from flux_klein_mlx.models.flux3.transformer import flux3_name

        names = {flux3_name(n): n for n in linear_names(reference)}
        return {
            names[layer]: np.roll(delta, delta.shape[0] // 2, 0) if names[layer] == "norm_out.linear" else delta
            for layer, delta in deltas.items()
        }

    def lokr(self, path, rng, params) -> dict[str, np.ndarray]:
        """LyCORIS LoKr on FLUX 3 names (BFL, diffusers' norm_out with its halves swapped, LyCORIS' underscored
        prefix with a low-rank w2 and alpha); returns {our layer: delta} from numpy, in our row order."""
        w1, w2, n1, n2 = rng.mat(4, 4, s=0.1), rng.mat(96, 16, s=0.1), rng.mat(2, 2, s=0.1), rng.mat(64, 32, s=0.1)
        v1, a, b = rng.mat(4, 8, s=0.1), rng.mat(16, 3, s=0.1), rng.mat(3, 8, s=0.1)
        mlp, out = "content_mode_blocks.image_cond.1.mlp_in", "lycoris_single_blocks_0_attn_out"
        sd = {
            f"{mlp}.lokr_w1": w1,
            f"{mlp}.lokr_w2": w2,
            "norm_out.linear.lokr_w1": n1,
            "norm_out.linear.lokr_w2": n2,
            f"{out}.lokr_w1": v1,
            f"{out}.lokr_w2_a": a,
            f"{out}.lokr_w2_b": b,
            f"{out}.alpha": torch.tensor(1.5),
        }
        save_file(sd, str(path))
        final = np.kron(n1.numpy(), n2.numpy())
        return {
            "content_mode_blocks.image_cond.1.mlp_in": np.kron(w1.numpy(), w2.numpy()),
            "final_layer.image.adaLN_modulation.1": np.roll(final, final.shape[0] // 2, 0),  # [shift ; scale]
            "single_blocks.0.attn_out": 0.5 * np.kron(v1.numpy(), (a @ b).numpy()),  # alpha 1.5 / rank 3
        }


LORAS = {"flux2": Flux2Loras(), "flux3": Flux3Loras()}


def save_bfl(path, modules, *, prefix="diffusion_model.", blocks_only=False) -> str:
    """ComfyUI / ai-toolkit: BFL names, alpha / rank folded into B (no alpha key: alpha = rank)."""
    out = {}
    for name, (down, up) in modules.items():
        if blocks_only and "blocks." not in name:
            continue
        out[f"{prefix}{name}.lora_A.weight"] = down.contiguous()
        out[f"{prefix}{name}.lora_B.weight"] = (up * ALPHA / RANK).contiguous()
    save_file(out, str(path))
    return str(path)


def save_kohya(path, modules) -> str:
    """kohya / musubi-tuner: `lora_unet_` + BFL names with underscores, lora_down / lora_up, alpha per module
    (alpha / rank as the adapter's: a fused rank-3r module gets 3 x alpha)."""
    out = {}
    for name, (down, up) in modules.items():
        stem = "lora_unet_" + name.replace(".", "_")
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
        out[f"{stem}.alpha"] = torch.tensor(ALPHA / RANK * down.shape[0])
    save_file(out, str(path))
    return str(path)


def save_diffusers(mixin: str, folder, sd, config) -> str:
    """What diffusers' training scripts write: `save_lora_weights` with the adapter's config as metadata."""
    import diffusers.loaders

    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    getattr(diffusers.loaders, mixin).save_lora_weights(folder, sd, transformer_lora_adapter_metadata=config)
    return str(folder / "pytorch_lora_weights.safetensors")


def diffusers_lora_image(kit, pipe, snapshot, files: list[tuple[str, float]], **run) -> np.ndarray:
    """diffusers' image of the family's pipeline `pipe` (the lora kit's `judge_pipeline`) with `files` [(path, scale)]
    loaded by its `load_lora_weights` and weighted by `set_adapters`, unloaded after; `run`: prompt, latents, steps."""
    names = [f"l{i}" for i in range(len(files))]
    for (path, _), name in zip(files, names, strict=True):
        pipe.load_lora_weights(str(path), adapter_name=name)
    try:
        if files:
            pipe.set_adapters(names, [s for _, s in files])
        return kit.judge_image(pipe, snapshot, **run)
    finally:
        if files:
            pipe.unload_lora_weights()


def diffusers_with(mixin: str, reference, files: list[tuple[str, float]]):
    """diffusers' LoRA loading, as the pipelines' `load_lora_weights` does it (its two steps: `lora_state_dict`,
    which converts BFL and kohya names, then `load_lora_into_transformer`), then `set_adapters` with the scales."""
    import diffusers.loaders

    loader = getattr(diffusers.loaders, mixin)
    model = copy.deepcopy(reference)
    names = []
    for i, (path, _) in enumerate(files):
        sd, metadata = loader.lora_state_dict(path, return_lora_metadata=True)
        assert all("lora" in k for k in sd)  # load_lora_weights' own check
        loader.load_lora_into_transformer(sd, transformer=model, adapter_name=f"a{i}", metadata=metadata)
        names.append(f"a{i}")
    model.set_adapters(names, weights=[s for _, s in files])
    return model
