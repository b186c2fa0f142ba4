"""Who may import whom (ARCHITECTURE.md), checked on the package's source with `ast`.

- model files (transformer, text_encoder, vae, rope) import no file I/O, loading, pipeline or CLI;
- the library (pipeline, loading, ...) never imports a CLI module;
- no import cycles, counting function-local imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flux_klein_mlx"
MODEL_FILES = {"models.transformer", "models.kv_cache", "models.recompute", "models.text_encoder", "models.vae", "models.rope"}
# The applications: CLI commands and the server (its HTTP app and worker).
CLI_MODULES = {"__main__", "cli", "generate", "convert", "bench.command", "serve.command", "serve.api", "serve.forms",
               "serve.jobs", "train.command", "lora.command"}
IO_MODULES = {"weights", "loading", "pipeline"}


def module_name(path: Path) -> str:
    """flux_klein_mlx/models/vae.py -> "models.vae"; a folder's __init__.py -> the folder's name."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def package_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules one source file imports anywhere (relative or absolute, function-local too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "__init__":
        package = []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            elif (node.module or "").startswith("flux_klein_mlx."):
                target = node.module.removeprefix("flux_klein_mlx.")
            else:
                continue
            found.add(target or "__init__")
            found.update(f"{target}.{a.name}" if target else a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("flux_klein_mlx.") for a in node.names if a.name.startswith("flux_klein_mlx."))
    return {m for m in found if m in modules and m != name}


def package_imports() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source."""
    files = package_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def test_model_files_never_read_files_or_reach_up():
    graph = package_imports()
    for model in MODEL_FILES:
        bad = graph[model] & (IO_MODULES | CLI_MODULES)
        assert not bad, f"{model}.py imports {sorted(bad)}"


def test_library_never_imports_a_cli_module():
    graph = package_imports()
    for module, imports in graph.items():
        if module in CLI_MODULES:
            continue
        bad = imports & CLI_MODULES
        assert not bad, f"{module}.py (library) imports CLI module(s) {sorted(bad)}"


def test_no_import_cycles():
    graph = package_imports()
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [module, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_walker_sees_relative_and_absolute_imports(tmp_path):
    """The checks above are only as good as the walker: it must see every import form."""
    graph = package_imports()
    assert "loading" in graph["pipeline"]  # from .loading import ...
    assert "models.config" in graph["models.transformer"]  # from .config import ... inside a folder
    assert "errors" in graph["models.transformer"]  # from ..errors import ...
    assert "pipeline" in graph["train.samples"]  # a function-local from ..pipeline import MemoryPlan, load
    assert "cli" in graph["generate"]


# --- the house's size rules (docs/style.md) -------------------------------------------------------------

SERVER_MODULES = {"serve.command", "serve.api", "serve.forms", "serve.jobs"}
COMMAND_MODULES = {"__main__", "generate", "convert", "bench.command"}  # commands the server must not reach into
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600


def sources() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in package_files().items()}


def test_the_server_imports_no_command_module():
    graph = package_imports()
    for module in SERVER_MODULES:
        bad = graph[module] & COMMAND_MODULES
        assert not bad, f"{module}.py (server) imports command module(s) {sorted(bad)}"


def test_no_private_name_crosses_modules():
    """`from .x import _y` (or `x._y`) reaches into another module's internals: make the name public."""
    crossings = []
    for module, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level >= 1 or (node.module or "").startswith("flux_klein_mlx")):
                crossings += [f"{module}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert not crossings, crossings


def test_no_function_over_80_lines():
    long = [f"{module}.{node.name}: {node.end_lineno - node.lineno + 1}"
            for module, tree in sources().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]  # fmt: skip
    assert not long, long


def test_no_file_over_600_lines():
    big = {p.name: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not big, big


def test_every_safe_write_lives_in_files_which_imports_only_errors():
    """files.py is the one home of temporary names, renames and links (issue 27): it imports only `errors`,
    and no other module renames, replaces or links a file itself."""
    assert package_imports()["files"] == {"errors"}
    writers = []
    for module, tree in sources().items():
        for node in ast.walk(tree):
            if (module != "files" and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "os" and node.attr in ("replace", "rename", "link", "symlink")):
                writers.append(f"{module}: os.{node.attr}")
            if module != "files" and isinstance(node, ast.Attribute) and node.attr == "mkstemp":
                writers.append(f"{module}: mkstemp")
    assert not writers, writers
