"""The command line run in this process, and what every refusal test checks of it.

`run_cli` is the one in-process run (conftest.py's `cli` fixture is it, bound to the test's capsys);
`assert_one_line_error` is issue 12's rule for bad input: exit 1, one `error: ` line, no traceback.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

from flux_klein_mlx.__main__ import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`flux-klein-mlx ARGS` in this process (paths and numbers as str): (exit code, stdout, stderr)."""
    code = main(list(map(str, args)))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *words):
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def tree_hash(path: Path) -> str:
    """Names, sizes and bytes of everything under `path` (or of the file)."""
    h = hashlib.sha256()
    paths = [path] if path.is_file() else sorted(p for p in path.rglob("*"))
    for p in paths:
        h.update(str(p.relative_to(path.parent)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def hub_cache(snapshot, cache: Path, repo_id: str) -> None:
    """Lay a snapshot out like huggingface_hub's cache: models--owner--name/{refs/main, snapshots/<rev>}."""
    import shutil

    rev = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(snapshot, root / "snapshots" / rev)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(rev)


def gen_args(snapshot, out, *extra):
    """`generate` in float32, 64x64, one step: the tiny run a refusal test would otherwise start."""
    return [
        "generate",
        "--model",
        snapshot,
        "-p",
        "a fox",
        "--dtype",
        "float32",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "1",
        "--seed",
        "1",
        "-o",
        out,
        *extra,
    ]


def default_args(model, out, *extra):
    """`generate` in the default dtype (bfloat16), tiny and fast."""
    return [
        "generate",
        "--model",
        model,
        "-p",
        "a fox",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "2",
        "--seed",
        "1",
        "-o",
        out,
        *extra,
    ]


def free_port() -> int:
    """A loopback port no one listens on now (for `serve --port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
