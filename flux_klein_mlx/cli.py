"""Running a click command as a program: user errors become one line, never a traceback.

Shared by `__main__` and each command module's `main()`, so that no command module imports
`__main__` (no import cycle).
"""

from __future__ import annotations

import warnings

import click

from . import preload_openblas
from .errors import FluxKleinError, Notice


def run_command(command: click.Command, argv=None) -> int:
    """Run a click command; user errors become one line on stderr and exit status 1."""
    preload_openblas()
    with warnings.catch_warnings():
        # A library warning is one line too ("warning: ..."), never a file/line dump.
        warnings.showwarning = lambda msg, category, *a, **k: click.echo(
            str(msg) if issubclass(category, Notice) else f"warning: {msg}", err=True)
        return _run(command, argv)


def _run(command: click.Command, argv) -> int:
    try:
        command.main(args=argv, prog_name="python -m flux_klein_mlx", standalone_mode=False)
    except FluxKleinError as e:
        click.echo(f"error: {e}", err=True)
        return 1
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    return 0
