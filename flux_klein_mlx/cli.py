"""The commands' plumbing: the options every command shares, worded and typed once, and running a click
command as a program (user errors become one line, never a traceback).

Shared by `__main__` and the command modules (`generate.main` and `bench.command.main` run one command
alone), so that no command module imports `__main__` (no import cycle). This module imports no mlx at its
top: `__main__` imports it before `run_command` binds OpenBLAS (the imports inside the option groups run
when a command module is loaded).
"""

from __future__ import annotations

import errno
import warnings

import click

from . import preload_openblas
from .errors import FluxKleinError, Notice


def stacked(options: list):
    """One decorator of several click options, listed (in --help) in the order they are written here."""

    def apply(command):
        for option in reversed(options):  # click lists options in the order their decorators are written
            command = option(command)
        return command

    return apply


def model_option(help: str, *name: str, **kwargs):
    """`--model` / `-m`: every command that reads a model says what it takes (and its default, if any); `name`
    the parameter's, where it is not `model` (serve's `models`)."""
    return click.option("--model", "-m", *name, help=help, **kwargs)


def as_bits(ctx, param, value: int | None) -> int | None:
    """`--quantize 4` -> 4, refused in one line unless 4 or 8; not given -> None."""
    from .models.quantize import check_bits  # imports mlx: run when the command runs, after OpenBLAS is bound

    if value is not None:
        check_bits(value)
    return value


def quantize_option(help: str, *decls: str):
    """`--quantize` / `-q` BITS: the same type and refusal in generate, convert, serve, train and benchmark (and
    train's `--sample-quantize`); `decls` the option's names, where they are not `--quantize`, `-q`."""
    return click.option(*(decls or ("--quantize", "-q")), type=int, default=None, callback=as_bits, help=help)


def dtype_option(*, default: str | None = "default", help: str | None = None):
    """`--dtype`: one of the dtypes' names; the default dtype unless a command asks for none."""
    from .dtypes import DEFAULT_DTYPE, DTYPES  # when the command module is loaded (it imports mlx)

    default = DEFAULT_DTYPE if default == "default" else default
    return click.option(
        "--dtype", type=click.Choice(list(DTYPES)), default=default, show_default=default is not None, help=help
    )


LORA_SOURCES = "a .safetensors file, owner/name (its single .safetensors) or owner/name:FILE"


def lora_options(purpose: str, *, scales: bool = True):
    """`--lora` (repeatable) and, where a command takes them by position, `--lora-scale`."""
    options = [click.option("--lora", "loras", multiple=True, help=f"{purpose}: {LORA_SOURCES}; repeatable.")]
    if scales:
        options.append(
            click.option(
                "--lora-scale",
                "lora_scales",
                type=float,
                multiple=True,
                help="Strength of each --lora, by position [default: 1.0].",
            )
        )
    return stacked(options)


vae_and_cache_options = stacked(
    [
        click.option(
            "--vae",
            default=None,
            help="Another VAE or decoder: repo id (e.g. "
            "black-forest-labs/FLUX.2-small-decoder), folder or .safetensors file.",
        ),
        click.option(
            "--no-cache", is_flag=True, help="Do not read or store prompt embeddings on disk (the text encoder runs)."
        ),
        click.option(
            "--cache-size",
            default="1GiB",
            show_default=True,
            help="Bound of the prompt-embedding cache on disk (e.g. 500MB, 2GB; 0 = off).",
        ),
    ]
)  # `--vae`, `--no-cache` and `--cache-size`, worded once for `generate` and `serve`


upsample_options = stacked(
    [
        click.option(
            "--upsample",
            is_flag=True,
            help="FLUX 3: rewrite the prompt into the full scene caption the model was trained on, with BFL's "
            'prompt upsampler (needs the extra: pip install -e ".[upsample]").',
        ),
        click.option(
            "--box",
            "boxes",
            multiple=True,
            help='FLUX 3 layout: "x0,y0,x1,y1:desc" in 0-1 of the width and height; repeat for several.',
        ),
        click.option(
            "--upsampler",
            default=None,
            help="The prompt upsampler: folder or repo id [default: black-forest-labs/flux-3-image-klein-pup].",
        ),
    ]
)  # `--upsample`, `--box` (repeatable) and `--upsampler`, worded once for `generate` and `upsample`


def run_command(command: click.Command, argv=None) -> int:
    """Run a click command; user errors become one line on stderr and exit status 1."""
    preload_openblas()
    with warnings.catch_warnings():
        # A library warning is one line too ("warning: ..."), never a file/line dump.
        warnings.showwarning = lambda msg, category, *a, **k: click.echo(
            str(msg) if issubclass(category, Notice) else f"warning: {msg}", err=True
        )
        try:
            result = command.main(args=argv, prog_name="python -m flux_klein_mlx", standalone_mode=False)
        except FluxKleinError as e:
            click.echo(f"error: {e.worded('cli')}", err=True)
            return 1
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            return 130
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            return 130
        except click.UsageError as e:  # click's own: an unknown option, a value out of an option's range
            where = f"; {e.ctx.command_path} --help lists the options" if e.ctx is not None else ""
            click.echo(f"error: {e.format_message().rstrip('.')}{where}", err=True)
            return 1
        except click.ClickException as e:
            e.show()
            return e.exit_code
        except click.exceptions.Exit as e:
            return e.exit_code
        except OSError as e:  # a path option no check read first, past the OS's limits (limits.check_path)
            if e.errno != errno.ENAMETOOLONG:
                raise
            name = str(e.filename)
            click.echo(
                f"error: {name[:60]}{'...' if len(name) > 60 else ''}: {e.strerror}; use a shorter path", err=True
            )
            return 1
    # A command that ends with ctx.exit(n): click returns n here (standalone_mode=False), not raises.
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
