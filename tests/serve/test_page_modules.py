"""The page's scripts are ES modules (issue 45): index.html loads one `type="module"` script, every script
imports what it uses and exports what others use, no two import each other (even through others), and
none declares a name in the page's global scope. Read from the files; no browser needed."""

from __future__ import annotations

import re
from pathlib import Path

STATIC = Path(__file__).resolve().parents[2] / "flux_klein_mlx" / "serve" / "static"
IMPORT = re.compile(r'^import\s+(?:[^"\n]*?\s+from\s+)?"\./([\w-]+)\.js";', re.M)


def scripts() -> dict[str, str]:
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(STATIC.glob("*.js"))}


def test_the_page_loads_its_scripts_as_modules():
    tags = re.findall(r"<script[^>]*>", (STATIC / "index.html").read_text(encoding="utf-8"))
    assert tags and all('type="module"' in tag for tag in tags), tags


def test_every_script_is_a_module_that_imports_only_existing_scripts():
    found = scripts()
    for name, text in found.items():
        assert re.search(r"^(import|export) ", text, re.M), f"{name}.js neither imports nor exports: not a module"
        assert '"use strict"' not in text, f"{name}.js: a module is strict already"
        missing = set(IMPORT.findall(text)) - set(found)
        assert not missing, f"{name}.js imports {sorted(missing)}, which static/ does not hold"


def test_no_circle_between_the_scripts():
    graph = {name: set(IMPORT.findall(text)) for name, text in scripts().items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for dep in graph[start] - seen:
            if dep == goal or reaches(dep, goal, seen | {dep}):
                return True
        return False

    circles = [name for name in graph if reaches(name, name, set())]
    assert not circles, f"scripts in an import circle: {circles}"


def test_only_the_named_test_handle_is_global():
    """A module's names are its own; the one name put on window is `flux`, which the browser tests read."""
    put = {m for text in scripts().values() for m in re.findall(r"\bwindow\.(\w+)\s*=", text)}
    assert put == {"flux"}, put
