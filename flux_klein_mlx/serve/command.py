"""`python -m flux_klein_mlx serve`: an OpenAI-compatible image server with a web page.

Needs the `serve` extra (`pip install -e ".[serve]"`: Starlette, uvicorn, python-multipart). Before
it says "serving" it holds its port and has checked the model's files and the LoRAs, so a busy port
or a missing model is one line and exit status 1. The model then loads in the background (the API
answers 503 until it is ready); a load that fails ends the process with one line, too.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from pathlib import Path

import click

from ..cli import dtype_option, lora_options, model_option, quantize_option, vae_and_cache_options
from ..errors import FluxKleinError
from ..run.pipeline import DEFAULT_MODEL, load


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads (uvicorn is handed it, and never binds itself)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse the port at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise FluxKleinError(
                f"port {port} on {host} is already in use (another server?); stop it or choose another --port"
            ) from None
        reason = e.strerror or str(e)
        raise FluxKleinError(f"cannot listen on {host}:{port} ({reason}); choose another --host or --port") from None
    return sock


KEY_VARIABLE = "FLUX_KLEIN_API_KEY"


def check_api_key(api_key: str | None) -> None:
    """An empty key would silently mean "no key"; a key of other than printable ASCII cannot travel in an
    HTTP header (browsers refuse it, other clients send other bytes): both are refused at start."""
    if api_key is None:
        return
    if not api_key.strip():
        raise FluxKleinError(
            f"--api-key is empty (or {KEY_VARIABLE} is set to nothing); give a key, or leave both "
            "out (unset the variable) for a server without one (loopback only)"
        )
    bad = next((c for c in api_key if not " " < c < "\x7f"), None)
    if bad is not None:
        raise FluxKleinError(
            f"--api-key holds {bad!r} (U+{ord(bad):04X}); HTTP headers carry printable ASCII only, "
            "so use letters, digits and punctuation (e.g. from `openssl rand -hex 16`)"
        )


def model_aliases(model: str, info) -> tuple[str, ...]:
    """The names a request's "model" may use besides --model-id: --model as given (a repo id or a path), the
    folder it resolved to, and the repo a converted folder came from."""
    names = [str(model), str(info.path)]
    if Path(str(model)).expanduser().exists():
        names.append(str(Path(str(model)).expanduser().resolve()))
    original = info.original.get("model") if isinstance(info.original, dict) else None
    if isinstance(original, str):
        names.append(original)
    return tuple(dict.fromkeys(n.rstrip("/") for n in names if n))


def check_before_start(host: str, api_key: str | None, save_dir, *, lora_dir, train_dir=None) -> None:
    """Refuse, before anything binds or loads, a server that cannot start as asked: the serve extra
    missing, an empty or non-ASCII key, a non-loopback address without a key, a --save-dir,
    --lora-dir or --train-dir that is not a folder, a --train-dir without --lora-dir (where jobs put LoRAs)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        try:  # python-multipart (uploads), under this name since 0.0.13; the old `multipart` name warns there
            import python_multipart  # noqa: F401
        except ImportError:
            import multipart  # noqa: F401
    except ImportError as e:
        raise FluxKleinError(f'serve needs the serve extra ({e.name} is missing): pip install -e ".[serve]"') from None
    check_api_key(api_key if api_key is not None else os.environ.get(KEY_VARIABLE))  # click reads "" as unset
    if not is_loopback(host) and not api_key:
        raise FluxKleinError(
            f"--host {host} exposes the server beyond this machine; set --api-key KEY too "
            "(clients then send 'Authorization: Bearer KEY')"
        )
    for name, folder in (("--save-dir", save_dir), ("--lora-dir", lora_dir), ("--train-dir", train_dir)):
        if folder is not None and not Path(folder).is_dir():
            raise FluxKleinError(f"{name} {folder} is not an existing folder; create it first")
    if train_dir is not None and lora_dir is None:
        raise FluxKleinError("--train-dir needs --lora-dir too: the folder fine-tuning jobs write their LoRAs to")


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _load_checked(model, sock, load_settings: dict):
    """The pipeline, its model's files and the LoRAs checked before saying "serving" (one line and exit 1 if
    not; the socket is closed then)."""
    try:
        pipe = load(model, **load_settings)
        pipe.check_text_encoder()  # load() leaves it to the first prompt that is not cached; a server checks all
    except BaseException:
        sock.close()
        raise
    return pipe


def model_ids(models, model_id) -> list[str]:
    """The id clients name each --model by: --model-id (one model only), else the last part of its path."""
    if model_id and len(models) > 1:
        raise FluxKleinError(
            "--model-id names the one --model; with several, each is named by the last part of its path"
        )
    ids = [model_id or Path(str(m).rstrip("/")).name for m in models]
    twice = next((i for i in ids if ids.count(i) > 1), None)
    if twice:
        raise FluxKleinError(
            f"--model {twice} is given twice (or two models share that last name); give each once, "
            "from a folder named as clients should name it"
        )
    return ids


def model_card(pipe) -> dict:
    """What the page needs to know of a served model before it is loaded."""
    info = pipe.info
    return {
        "variant": info.name,
        "distilled": info.is_distilled,
        "default_steps": info.default_steps,
        "upsampler": bool(info.family.upsampler),  # FLUX 3: the page offers `upsample` and layout boxes for it
    }


def other_models(ids, models, pipes) -> tuple:
    """((id, aliases, card), ...) of every --model after the first (ServerOptions.other_models)."""
    return tuple(
        (i, model_aliases(m, p.info), model_card(p)) for i, m, p in zip(ids[1:], models[1:], pipes[1:], strict=True)
    )


@click.command("serve")
@model_option(
    "Hugging Face repo id, diffusers folder, or a folder written by `convert`; repeat to serve several "
    "(one in memory at a time: a request naming another switches).",
    "models",
    multiple=True,
    default=(DEFAULT_MODEL,),
    show_default=True,
)
@quantize_option("Quantize transformer and text encoder at load to 4 or 8 bits.")
@dtype_option()
@click.option("--low-memory", is_flag=True, help="Release the transformer before decoding (small-memory Macs).")
@lora_options("A LoRA loaded with the model (optionally :SCALE after it)", scales=False)
@click.option("--lora-dir", default=None, help='Folder of .safetensors LoRAs that requests may name ("loras").')
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; anything but loopback requires --api-key.",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--api-key",
    envvar=KEY_VARIABLE,
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1 (or set FLUX_KLEIN_API_KEY).",
)
@click.option(
    "--queue",
    "queue_size",
    type=click.IntRange(0, 1000),
    default=8,
    show_default=True,
    help="Requests that may wait behind the running one; more get HTTP 429.",
)
@click.option("--save-dir", default=None, help="Also save every result here (server-chosen file names).")
@click.option(
    "--max-upload-mb",
    type=click.FloatRange(0.1, 200),
    default=20,
    show_default=True,
    help="Largest accepted image upload.",
)
@click.option(
    "--train-dir",
    default=None,
    help="Folder of training data and fine-tuning jobs (POST /v1/files, /v1/fine_tuning/jobs); needs --lora-dir.",
)
@click.option("--model-id", default=None, help="The model name clients use [default: the last part of --model].")
@click.option("--upsampler", default=None, help="FLUX 3's prompt upsampler for `upsample` requests: folder or repo id.")
@vae_and_cache_options
def serve(
    models,
    *,
    quantize,
    dtype,
    low_memory,
    loras,
    lora_dir,
    host,
    port,
    api_key,
    queue_size,
    save_dir,
    max_upload_mb,
    train_dir,
    model_id,
    upsampler,
    vae,
    no_cache,
    cache_size,
):
    """Serve the OpenAI Images API and a web page with live step previews."""
    check_before_start(host, api_key, save_dir, lora_dir=lora_dir, train_dir=train_dir)
    ids = model_ids(models, model_id)
    # The server modules import the serve extra (checked above), so they are imported only here.
    from .api import ServerOptions
    from .guard import MB

    sock = bind(host, port)
    t0 = time.perf_counter()
    load_settings = dict(dtype=dtype, quantize=quantize, low_memory=low_memory)
    load_settings.update(loras=loras, vae=vae, cache=not no_cache, cache_size=cache_size, upsampler=upsampler)
    pipes = [_load_checked(model, sock, load_settings) for model in models]  # every model's files checked
    model, pipe, model_id = models[0], pipes[0], ids[0]
    options = ServerOptions(
        model_id=model_id,
        model_aliases=model_aliases(model, pipe.info),
        model_card=model_card(pipe),
        other_models=other_models(ids, models, pipes),
        server_loras=tuple(f"{Path(lora.name).stem}:{lora.scale:g}" for lora in pipe.loras),
        api_key=api_key,
        lora_dir=Path(lora_dir) if lora_dir else None,
        save_dir=Path(save_dir) if save_dir else None,
        max_upload_bytes=int(max_upload_mb * MB),
        train_dir=Path(train_dir).resolve() if train_dir else None,
        model_folders={i: p.info.path for i, p in zip(ids, pipes, strict=True)},
        log=lambda line: click.echo(line, err=True),
    )
    shown = f"[{host}]" if ":" in host else host
    click.echo(
        f"{pipe.info.name} from {model}: serving {', '.join(map(repr, ids))} at http://{shown}:{port}/ "
        f"(API: http://{shown}:{port}/v1); loading the model",
        err=True,
    )
    _run_server(
        pipe, options, sock=sock, queue_size=queue_size, t0=t0, switch=dict(zip(ids, pipes, strict=True)).__getitem__
    )


def _run_server(pipe, options, *, sock, queue_size: int, t0: float, switch=None) -> None:
    """Answer on `sock` until stopped; the models load on the worker thread while the server already
    answers (503 until ready). A model that fails to load ends the process with one line."""
    import uvicorn

    from .api import create_app
    from .jobs import Worker

    def loader():  # on the worker thread
        try:
            if not pipe.memory.release_models:
                pipe.component("transformer")  # resident anyway: loaded now rather than in the first request
            pipe.preview_map()  # the VAE
        except BaseException:
            server.should_exit = True  # the process ends with the error below, not as a server answering 503
            raise
        click.echo(f"model loaded in {time.perf_counter() - t0:.1f} s", err=True)
        return pipe

    worker = Worker(loader, max_queue=queue_size, model_id=options.model_id, switch=switch)
    server = uvicorn.Server(
        uvicorn.Config(create_app(worker, options), log_level="warning", timeout_graceful_shutdown=5)
    )
    worker.start()
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
    if worker.state == "failed":
        raise FluxKleinError(f"the model failed to load: {worker.error}")
