"""The documents hold: every path the repository names exists in a clone, every link lands on a file
and a heading that exist, and the README stays a ten-minute read.

Where a path is named: the Markdown files, `.ci/run`, and the comments and docstrings of every
Python file (string literals are code: their paths are exercised by the tests that run them).
A named path is read from the repository's root or from the package (`train/settings.py` is
`flux_klein_mlx/train/settings.py`); `lora/layers.LoRALinear` names a module and one of its names;
`docs/training.md#the-objective` names a heading, which must exist too.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flux_klein_mlx"
README_MAX_LINES = 300

# A path starts at one of the repository's folders or the package's wings, after a character that
# cannot be part of a longer path (so `ink.train/train.json` and `~/.cache/flux_klein_mlx/x` are not
# read as `train/...` or `flux_klein_mlx/...`).
FOLDERS = (
    "docs|tests|benchmarks|convert|quantize|flux_klein_mlx"
    "|models|lora|train|serve|bench|family|inputs|record|storage|run|upsample"
)
NAMED_PATH = re.compile(rf"(?<![\w./~$<@-])((?:{FOLDERS})/[\w./-]*)(#[\w-]+)?")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _sources() -> list[Path]:
    files = sorted(ROOT.glob("*.md")) + [ROOT / ".ci" / "run", ROOT / "conftest.py"]
    for folder in ("docs", "flux_klein_mlx", "tests", "benchmarks", "convert", "quantize"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".md", ".py"))
    return [p for p in files if p.is_file()]


def _prose(path: Path) -> str:
    """The text of `path` a reader takes for documentation: all of a Markdown file or script, the
    comments and docstrings of a Python file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return text
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(parts)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def _resolve(named: str) -> Path | None:
    """The file or folder `named` names, from the root or the package; a module for `mod.attr`."""
    named = named.rstrip("./") or named
    for base in (ROOT, PACKAGE):
        for candidate in (named, named + ".py", named.rsplit(".", 1)[0] + ".py"):
            if (base / candidate).exists():
                return base / candidate
    return None


def _missing_named_paths() -> list[str]:
    missing = []
    for source in _sources():
        for m in NAMED_PATH.finditer(_prose(source)):
            target, anchor = _resolve(m.group(1)), m.group(2)
            where = f"{source.relative_to(ROOT)}: {m.group(0)}"
            if target is None:
                missing.append(where)
            elif anchor and target.suffix == ".md" and anchor[1:] not in _anchors(target):
                missing.append(where + " (no such heading)")
    return missing


def test_every_named_path_exists():
    assert _missing_named_paths() == []


def test_named_path_pattern_skips_paths_inside_longer_ones():
    text = "ink.train/train.json, ~/.cache/flux_klein_mlx/embeddings, see docs/training.md#the-objective."
    assert [m.group(1) + (m.group(2) or "") for m in NAMED_PATH.finditer(text)] == ["docs/training.md#the-objective"]
    assert _resolve("lora/layers.LoRALinear") == PACKAGE / "lora" / "layers.py"
    assert _resolve("docs/no-such-file.md") is None


def _markdown_files() -> list[Path]:
    return [p for p in _sources() if p.suffix == ".md"]


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_markdown_link_lands(md: Path):
    broken = []
    for m in MD_LINK.finditer(md.read_text(encoding="utf-8")):
        link = m.group(1)
        if re.match(r"^[a-z]+:", link):  # https:, mailto: ... are the web's, not ours
            continue
        file, _, anchor = link.partition("#")
        target = (md.parent / file).resolve() if file else md
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no such heading)")
    assert broken == []


def test_readme_is_a_ten_minute_read():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md is {len(lines)} lines; move reference material to docs/"


def test_readme_test_command_is_the_one_ci_runs():
    command = "python -m pytest -q -n 2 --dist loadfile tests"
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert command in (ROOT / "README.md").read_text(encoding="utf-8")


def test_docs_tests_lists_every_test_file():
    listed = (ROOT / "docs" / "tests.md").read_text(encoding="utf-8")
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    assert [f for f in files if f"`{f}`" not in listed] == []


# A backticked `module.name` in the documents: `lora/names.target_table`, `family.FAMILIES`, `checks.is_int`.
# File names (`train.json`, `loss.png`) are not modules.
BACKTICKED = re.compile(r"`([A-Za-z_][\w/]*)\.([A-Za-z_]\w*)`")
FILE_SUFFIXES = {"json", "jsonl", "png", "jpg", "jpeg", "webp", "safetensors", "md", "py", "toml", "txt", "js", "html"}


def _modules() -> dict[str, Path]:
    """ "storage/files" -> its file; a folder's name -> its __init__.py (`family` -> family/__init__.py)."""
    found = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if parts:
            found["/".join(parts)] = p
    return found


def _defined(path: Path) -> set[str]:
    """The names a module binds at its top level: defs, classes, assignments and imports."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _undefined_module_names() -> list[str]:
    """Each backticked `module.name` in README.md, ARCHITECTURE.md and docs/ whose module is ours: the name
    must be defined there, and the module named by its path from the package (`storage/files`, not `files`),
    so that a reader finds it."""
    modules = _modules()
    by_basename: dict[str, list[str]] = {}
    for path in modules:
        by_basename.setdefault(path.rsplit("/", 1)[-1], []).append(path)
    bad = []
    for md in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for module, name in BACKTICKED.findall(md.read_text(encoding="utf-8")):
            where = f"{md.relative_to(ROOT)}: `{module}.{name}`"
            if name in FILE_SUFFIXES:
                continue
            if module in modules:
                if name not in _defined(modules[module]):
                    bad.append(f"{where}: {module} defines no {name}")
            elif module in by_basename:
                bad.append(f"{where}: name the module by its path ({' or '.join(by_basename[module])})")
    return bad


def test_every_backticked_module_name_is_defined():
    assert _undefined_module_names() == []


# What a reader types from the documents: `flux_klein_mlx.record.output.read_record` in prose, and the names of
# `from flux_klein_mlx.convert import convert_model` in a code block.
DOTTED = re.compile(r"\bflux_klein_mlx(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*from (flux_klein_mlx[\w.]*) import ([\w, ]+)$", re.MULTILINE)


def _resolves(dotted: str) -> bool:
    """Import the longest module prefix of `dotted`, then read the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def _unresolved_python_names() -> list[str]:
    bad = []
    for md in _markdown_files():
        text = md.read_text(encoding="utf-8")
        named = set(DOTTED.findall(text))
        for module, names in FROM_IMPORT.findall(text):
            named |= {f"{module}.{name.strip()}" for name in names.split(",")}
        bad += [f"{md.relative_to(ROOT)}: {name}" for name in sorted(named) if not _resolves(name)]
    return bad


def test_every_python_name_the_documents_give_resolves():
    assert _unresolved_python_names() == []
    assert _resolves("flux_klein_mlx.record.output.read_record")
    assert not _resolves("flux_klein_mlx.convert.load_mlx_folder")


def test_the_documents_state_no_test_count():
    """A count of tests or of their minutes in a document is stale by the next commit: pytest's closing
    line is the one home of that number."""
    stated = re.compile(r"\b\d[\d,]* (?:tests|passed)\b|\btests in \d")
    found = [
        f"{md.relative_to(ROOT)}: {m.group(0)!r}"
        for md in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
        for m in stated.finditer(md.read_text(encoding="utf-8"))
    ]
    assert found == []
