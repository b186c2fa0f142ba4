"""`python -m flux_klein_mlx generate | convert | quantize | benchmark | serve | train | lora | upsample`.

Each subcommand lives in its own module and is imported only when used, so `--help` is instant.
Every user-fixable problem (`FluxKleinError`) ends as one line on stderr and exit status 1.
"""

from __future__ import annotations

import importlib
import sys

import click

from . import __version__
from .cli import run_command

# subcommand -> (module, click command attribute)
COMMANDS = {
    "generate": ("flux_klein_mlx.generate", "generate"),
    "convert": ("flux_klein_mlx.convert", "convert"),
    "quantize": ("flux_klein_mlx.convert", "quantize_command"),
    "benchmark": ("flux_klein_mlx.bench.command", "benchmark"),
    "serve": ("flux_klein_mlx.serve.command", "serve"),
    "train": ("flux_klein_mlx.train.command", "train"),
    "lora": ("flux_klein_mlx.lora.command", "lora"),
    "upsample": ("flux_klein_mlx.caption", "upsample"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name in COMMANDS:  # else None: click's "No such command"
            module, attr = COMMANDS[name]
            return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="flux_klein_mlx", message="%(prog)s %(version)s")
def cli():
    """FLUX.2 [klein] image generation on MLX."""


def main(argv=None) -> int:
    return run_command(cli, argv)


if __name__ == "__main__":
    sys.exit(main())
