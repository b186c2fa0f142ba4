"""What a klein model on disk is, decided once: `describe`, and what a described model may be used for.

    info = describe("black-forest-labs/FLUX.2-klein-4B")   # resolve, classify, check; reads configs only

`describe` resolves a repo id / folder / file, classifies it (diffusers snapshot, BFL single-file
transformer with a base snapshot, or a folder written by `convert`), decides its family
(`family/`), refuses FLUX.1 / FLUX.2-dev, and checks that the three components fit together. What a
described model may be used for is decided here too, worded once: `check_for_loading` (`load()` and
`train`). Loading a component (config -> module -> sanitize -> strict load) is `components.py`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from mlx.utils import tree_flatten

from ..errors import FluxKleinError
from ..family import FAMILIES, Family, family_named, family_of_class, family_of_names
from ..lora.formats import is_lora_file
from ..models.config import AutoEncoderConfig, Qwen3Config
from ..models.quantize import already_quantized, check_record
from ..models.text_encoder import Qwen3TextEncoder
from ..models.vae import AutoEncoder, check_flux2
from ..storage.vae_source import decoder_config, decoder_only, infer_vae_config, vae_weights
from ..storage.weights import (
    check_safetensors_file,
    component_files,
    prefixed_files,
    read_json,
    read_safetensors,
    read_weight_files,
    resolve_model,
)

COMPONENTS = ("transformer", "text_encoder", "vae")
WHAT = {"transformer": "transformer", "text_encoder": "text encoder", "vae": "VAE"}

# The marker of a folder written by `convert` (config.json "format" / "format_version").
FORMAT = "flux_klein_mlx"
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class ModelInfo:
    """What the files say about a model (never guessed from its name)."""

    source: str  # what the caller passed: repo id, folder or file
    path: Path  # the resolved snapshot folder, BFL file or converted folder
    format: str  # "diffusers" | "bfl" | "mlx"
    is_distilled: bool
    configs: dict[str, dict]  # component -> its config dict (Hugging Face names, or ours)
    files: dict[str, list[Path]]  # component -> its safetensors files
    quantization: dict[str, dict | None]  # component -> stored quantization record (converted folders)
    tokenizer: Path  # the tokenizer folder
    scheduler: dict | None = None  # scheduler_config.json, kept for converted folders
    stored_dtype: str | None = None  # a converted folder's dtype
    original: dict | None = None  # a converted folder's own "source" entry
    reference_kv: bool = False  # klein 9B-KV: reference K/V computed once per image, then cached
    vae_source: str | None = None  # `vae=` (--vae): where the VAE, or only its decoder, comes from
    decoder_files: list[Path] | None = None  # a decoder-only `vae=`: its files (the rest is files["vae"])
    family: Family  # what the model's generation contributes (family/__init__.py)
    params: object = field(init=False)  # the family's transformer hyper-parameters (`Family.params_type`)

    def __post_init__(self):
        self.params = self.family.params(self.configs["transformer"])

    @property
    def variant(self) -> str:
        """ "klein-4b", "klein-9b" or "other" (a custom size), from the transformer's shapes."""
        return self.params.variant

    @property
    def stored_quantization(self) -> dict | None:
        """The quantization record a converted folder was written with (the first quantized component's), or None."""
        return next((r for r in self.quantization.values() if r), None)

    @property
    def in_channels(self) -> int:
        return self.params.in_channels

    @property
    def default_steps(self) -> int:
        return self.family.defaults(self.is_distilled)[0]

    @property
    def default_guidance(self) -> float | None:
        return self.family.defaults(self.is_distilled)[1]

    @property
    def name(self) -> str:
        return self.family.model_title(self.params, self.is_distilled, self.reference_kv)


# --- describe ------------------------------------------------------------------------------------


def read_mlx_config(folder: str | Path) -> dict:
    """The config.json of a converted folder, checked for our format marker and version."""
    path = Path(folder) / "config.json"
    config = read_json(path)
    if config.get("format") != FORMAT:
        raise FluxKleinError(
            f"{folder} is not a folder written by `flux_klein_mlx convert` (no format marker in config.json)"
        )
    if int(config.get("format_version", 0)) > FORMAT_VERSION:
        raise FluxKleinError(
            f"{folder} was written by a newer flux_klein_mlx (format {config['format_version']}); "
            "upgrade flux_klein_mlx"
        )
    for name in COMPONENTS:
        entry = config.get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            raise FluxKleinError(f"{path} has no {WHAT[name]} config; convert the model again")
        if entry.get("quantization") is not None:
            check_record(entry["quantization"], WHAT[name])
    return config


def is_mlx_folder(path: str | Path) -> bool:
    """Whether `path` is a folder written by `convert` (has a config.json with our format marker)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):  # no config.json, not JSON, not a table
        return False


def _bfl_transformer_config(file: Path, base: Path, family: Family) -> dict:
    """Hyper-parameters of a BFL single file: the base snapshot's when its shapes agree (it also
    carries theta/eps/axes), else the file's own shapes."""
    params = family.infer_params(family.sanitize_transformer(read_safetensors(file)))
    config = _optional_json(base / "transformer" / "config.json")
    if config is not None and family.params(config).shape_key() == params.shape_key():
        return config
    return dataclasses.asdict(params)


def _check_fit(configs: dict[str, dict], where: dict[str, Path], family: Family) -> None:
    """The transformer must read what the text encoder and the VAE make."""
    params = family.params(configs["transformer"])
    vae = AutoEncoderConfig.from_dict(configs["vae"])
    check_flux2(vae, None)
    te_width = Qwen3Config.from_dict(configs["text_encoder"]).hidden_size
    width = len(family.text_taps) * te_width  # the encoder's stacked hidden states
    if params.context_in_dim != width:
        encoder = {2560: "Qwen3-4B", 4096: "Qwen3-8B"}.get(te_width)
        dit = {7680: "klein-4B", 12288: "klein-9B"}.get(params.context_in_dim)
        names = (
            f"the text encoder is {encoder}, the transformer {dit}"
            if encoder and dit
            else "use the text encoder from the same snapshot as the transformer"
        )
        raise FluxKleinError(
            f"text encoder hidden size {te_width} ({where['text_encoder']}) gives {width}-wide embeddings but the "
            f"{family.title} transformer expects {params.context_in_dim} (joint_attention_dim): {names}"
        )
    if params.in_channels != vae.token_channels:
        raise FluxKleinError(
            f"the transformer reads {params.in_channels} latent channels but the VAE in {where['vae']} makes "
            f"{vae.token_channels}; the snapshot mixes components of different models (use the FLUX.2 VAE)"
        )


def describe(model: str | Path, base: str | Path | None = None, vae: str | Path | None = None) -> ModelInfo:
    """Resolve and classify `model` and check it, reading configs only (no weights).

    `model` is a Hugging Face repo id (through the hub cache), a diffusers snapshot folder, a
    folder written by `convert`, or a BFL single-file transformer (`.safetensors`) whose text
    encoder, VAE and tokenizer come from `base` (default: the folder the file is in). `vae`
    replaces the model's VAE, or only its decoder (see `with_vae`).
    """
    info = _describe(model, base)
    return info if vae is None else with_vae(info, vae)


def _describe(model: str | Path, base: str | Path | None) -> ModelInfo:
    path = resolve_model(model, size_hint=lambda: download_bytes(str(model)))
    if path.is_file():
        return _describe_bfl(model, path, base)
    if is_mlx_folder(path):
        config = read_mlx_config(path)
        return ModelInfo(
            source=str(model),
            path=path,
            format="mlx",
            is_distilled=bool(config.get("is_distilled")),
            configs={n: config[n]["config"] for n in COMPONENTS},
            files={n: prefixed_files(path, n) for n in COMPONENTS},
            quantization={n: config[n].get("quantization") for n in COMPONENTS},
            tokenizer=path / config.get("tokenizer", "tokenizer"),
            scheduler=config.get("scheduler"),
            stored_dtype=config.get("dtype"),
            original=config.get("source"),
            reference_kv=bool(config.get("reference_kv", False)),
            family=family_named(config["family"])
            if "family" in config
            else family_of_names(()),  # before families: FLUX.2's
        )
    family = _folder_family(path)
    index_file = next((path / n for n in family.index_files if (path / n).is_file()), None)
    if index_file is None:
        raise FluxKleinError(
            f"{path} is not a {family.title} snapshot or model folder: no {' or '.join(family.index_files)} (diffusers "
            "layout) and no config.json written by `convert`"
        )
    index = read_json(index_file)
    kind = index.get("_class_name")
    other = next((f for f in FAMILIES.values() if f is not family and kind in f.pipeline_classes), None)
    if other is not None:  # e.g. a FLUX 3 transformer/ dropped into a FLUX.2 snapshot
        raise FluxKleinError(
            f"{path} mixes two models: its transformer is {family.title} (transformer/config.json) but "
            f"{index_file.name} names {kind} ({other.title}); use a complete snapshot of one model"
        )
    if kind not in family.pipeline_classes:
        raise FluxKleinError(
            f"{path} holds a {kind} model; flux_klein_mlx runs "
            + " and ".join(f"{f.title} ({', '.join(f.pipeline_classes)})" for f in FAMILIES.values())
        )
    folders = {n: path / n for n in COMPONENTS}
    configs = {n: read_json(folders[n] / "config.json") for n in COMPONENTS}  # a missing folder: its config is missing
    if configs["transformer"].get("guidance_embeds"):
        raise FluxKleinError(
            f"not a klein checkpoint: it is FLUX.2-dev ({folders['transformer'] / 'config.json'} has guidance_embeds); "
            "use a FLUX.2 [klein] 4B or 9B model"
        )
    snapshot = {"fmt": "diffusers", "snapshot": path, "index": index, "folders": folders, "family": family}
    return _snapshot_info(model, path, configs=configs, files={}, **snapshot)


def _folder_family(path: Path) -> Family:
    """A diffusers folder's family, told by its class names (FLUX 3's sizes are klein-4B's): the first later family
    whose class prefix one of its index files or its transformer config carries (so a FLUX 3 transformer/ in a
    FLUX.2 snapshot is found, and refused as a mix); else the first family's (`family_of_names`: it reads FLUX.1's
    and FLUX.2-dev's folders too, to refuse them)."""
    first = family_of_names(())
    for name in ("modular_model_index.json", "model_index.json", "transformer/config.json"):
        try:
            config = _optional_json(path / name)
        except FluxKleinError:  # unreadable: the checks after this say so where the file is needed
            continue
        family = family_of_class(config.get("_class_name") if isinstance(config, dict) else None)
        if family not in (None, first):
            return family
    return first


def _describe_bfl(model, file: Path, base) -> ModelInfo:
    if file.suffix != ".safetensors":
        raise FluxKleinError(
            f"{file} is not a .safetensors file; pass a model folder, a repo id or a BFL .safetensors file"
        )
    # The header's names tell the family, before any base folder is needed (FLUX 3's sizes are klein-4B's).
    family = family_of_names(check_safetensors_file(file))
    if is_lora_file(file):  # `convert --model a_lora.safetensors` included: a LoRA is said to be one
        raise single_file_refusal(file)
    base_path = resolve_model(base) if base is not None else file.parent
    folders = {n: base_path / n for n in ("text_encoder", "vae")}
    if not all(f.is_dir() for f in folders.values()):
        raise FluxKleinError(
            f"{file.name} is a single {family.title} transformer file: it needs the text encoder, VAE and tokenizer "
            f"of a diffusers snapshot, and {base_path} has none; pass --base with a {family.title} folder or repo id"
        )
    if _folder_family(base_path) is not family:
        raise FluxKleinError(
            f"{file} is a {family.title} transformer but {base_path} is not a {family.title} snapshot; pass --base "
            f"with a {family.title} folder or repo id"
        )
    configs = {"transformer": _bfl_transformer_config(file, base_path, family)}
    configs.update({n: read_json(folders[n] / "config.json") for n in folders})
    index = next((read_json(base_path / n) for n in family.index_files if (base_path / n).is_file()), {})
    snapshot = {"fmt": "bfl", "snapshot": base_path, "index": index, "folders": folders, "family": family}
    info = _snapshot_info(model, file, configs=configs, files={"transformer": [file]}, **snapshot)
    # A Base checkpoint next to (or based on) a distilled snapshot is still a Base model.
    info.is_distilled = info.is_distilled and "base" not in file.name.lower()
    return info


def _snapshot_info(
    model, path: Path, *, fmt: str, snapshot: Path, index: dict, configs: dict, folders: dict, files: dict, family
) -> ModelInfo:
    """A diffusers snapshot's ModelInfo (`snapshot` has the tokenizer, scheduler and `folders`), checked."""
    _check_fit(configs, folders, family)
    kv = family.reference_kv(index)
    # FLUX 3's hub repos keep the tokenizer files in text_encoder/ (there is no tokenizer/ folder)
    tokenizer = snapshot / "tokenizer" if (snapshot / "tokenizer").is_dir() else snapshot / "text_encoder"
    return ModelInfo(
        source=str(model),
        path=path,
        format=fmt,
        is_distilled=family.is_distilled(index, configs["transformer"]),
        configs=configs,
        files={**files, **{n: component_files(f) for n, f in folders.items()}},
        quantization=dict.fromkeys(COMPONENTS),
        tokenizer=tokenizer,
        scheduler=_optional_json(snapshot / "scheduler" / "scheduler_config.json"),
        reference_kv=kv,
        family=family,
    )


def download_bytes(repo: str) -> int | None:
    """About how many bytes the download of a published model of any family is (None for another repo): its
    components' bf16 weights, every text-encoder layer included, counted from the shapes of lazily
    built modules (nothing is allocated)."""
    rows = ((f, v) for f in FAMILIES.values() for v in f.variants.values() if v.repo.lower() == repo.lower())
    family, variant = next(rows, (None, None))
    if variant is None:
        return None
    te = variant.text_encoder
    modules = (
        family.build_transformer(variant.transformer),
        Qwen3TextEncoder(te, (te.num_hidden_layers,)),
        AutoEncoder(variant.vae),
    )
    count = sum(a.size for m in modules for _, a in tree_flatten(m.parameters()))
    count += te.hidden_size * (1 + (0 if te.tie_word_embeddings else te.vocab_size))  # final norm, untied lm_head
    return 2 * count


def _optional_json(path: Path) -> dict | None:
    return read_json(path) if path.is_file() else None


# What a `vae=` repo id needs from the hub: a VAE repo's root (BFL's small decoder) or a snapshot's vae/.
# The root's BFL-named single file duplicates the diffusers one and is skipped.
VAE_PATTERNS = ["config.json", "diffusion_pytorch_model*.safetensors*", "vae/*", "vae.safetensors*"]


def with_vae(info: ModelInfo, source: str | Path) -> ModelInfo:
    """`info` with the VAE of `source` (e.g. black-forest-labs/FLUX.2-small-decoder), checked.

    `source` is a VAE folder (config.json + weights), a model snapshot or converted folder (its VAE),
    a single `.safetensors` VAE (config from its shapes) or a repo id of one of these. A whole VAE
    replaces the model's; a decoder alone replaces only the decoder (`vae_source.py`). Reads
    configs and safetensors headers only.
    """
    try:
        path = resolve_model(source, allow_patterns=VAE_PATTERNS)
    except FluxKleinError as e:
        raise FluxKleinError(f"VAE: {e}".replace("model '", "'", 1)) from None
    config, files, where = _vae_files(path)
    weights = vae_weights(read_weight_files(files))  # lazy: nothing but the headers is read
    if config is None:
        config = infer_vae_config(weights, info.configs["vae"], where)
    if decoder_only(weights):
        config = decoder_config(info.configs["vae"], config, where)
        swap = {"decoder_files": files}
    else:  # a whole VAE, as diffusers' `vae=` argument
        swap = {"files": {**info.files, "vae": files}, "decoder_files": None}
    new = dataclasses.replace(info, configs={**info.configs, "vae": config}, vae_source=str(source), **swap)
    _check_fit(new.configs, {"text_encoder": info.files["text_encoder"][0].parent, "vae": Path(where)}, info.family)
    return new


def _vae_files(path: Path) -> tuple[dict | None, list[Path], str]:
    """(config or None for a single file, weight files, name for messages) of a VAE source."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise FluxKleinError(
                f"{path} is not a .safetensors file; pass a VAE folder, a .safetensors VAE or a repo id"
            )
        return None, [path], str(path)
    if is_mlx_folder(path):
        return read_mlx_config(path)["vae"]["config"], prefixed_files(path, "vae"), str(path)
    folder = path / "vae" if (path / "vae").is_dir() else path
    config = _optional_json(folder / "config.json")
    if not isinstance(config, dict) or "block_out_channels" not in config:
        raise FluxKleinError(
            f"{path} has no VAE: expected a config.json with block_out_channels and its weights (a VAE repo such as "
            "black-forest-labs/FLUX.2-small-decoder, a vae/ folder, or a model folder with one), or a .safetensors file"
        )
    single = folder / "diffusion_pytorch_model.safetensors"
    indexed = any(folder.glob("*.safetensors.index.json"))
    return config, [single] if single.is_file() and not indexed else component_files(folder), str(folder)


# --- what a described model may be used for --------------------------------------------------------


def single_file_refusal(path) -> FluxKleinError:
    """The one wording for a single file given where a model is needed (a BFL checkpoint, a LoRA: named as
    one, no command makes a model of it): `load()`, `generate`, `serve`, `train` and `convert` say the same."""
    need = "generate, serve and train need a klein model folder or repo id (train: a klein Base model folder or "
    need += "repo id, e.g. black-forest-labs/FLUX.2-klein-base-4B)"
    if is_lora_file(path):
        on = f"a LoRA goes on a model: generate --lora {path}, serve --lora-dir"
        return FluxKleinError(f"{path} is a single file holding a LoRA, not a model; {need} as --model; {on}")
    return FluxKleinError(
        f"{path} is a single file, not a model folder; {need}; "
        f"a klein checkpoint file becomes a folder with: python -m flux_klein_mlx convert --model {path} --output DIR"
    )


def check_for_loading(info: ModelInfo, quantize: int | None) -> None:
    """The refusals every user of a described model shares (`load()` and `train`), before any weight is read."""
    if info.format == "bfl":
        raise single_file_refusal(info.path)
    stored = info.stored_quantization
    if stored and quantize is not None and quantize != stored["bits"]:
        instead = f"leave --quantize out, or quantize the unquantized folder to {quantize} bits"
        raise already_quantized(str(info.path), stored["bits"], instead)
