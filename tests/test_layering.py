"""The house's rules (ARCHITECTURE.md), checked on the package's source with `ast`.

Who may import whom:
- `models/` imports only `models/` and `errors`: the networks never read files or reach up;
- the wings `train/`, `serve/` and `bench/` are imported by nothing but `__main__` (and their own modules;
  `serve/` runs `train/`'s library for its fine-tuning jobs);
- the library never imports a command module, and the server imports no other command;
- no import cycles, counting function-local imports too; no `_private` name crosses modules.
- a wing laid out along a flow (`train/`) has floors: its modules import only lower floors.
How big a room may be: a file, a folder, a function; `# fmt: skip` only on a few data tables.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flux_klein_mlx"
WINGS = ("train", "serve", "bench")  # the applications in folders: nothing but __main__ reaches in
# ... but for these: the server's fine-tuning jobs are `train` run on its worker thread, so
# serve/ may use train/'s library (never its command: test_the_server_imports_no_other_command).
WING_USERS = {"train": ("serve",)}
COMMAND_MODULES = {
    "__main__",
    "cli",
    "generate",
    "convert",
    "bench.command",
    "serve.command",
    "train.command",
    "lora.command",
    "caption",
}
MAX_FILE_LINES = 550
MAX_FUNCTION_LINES = 60
MAX_FOLDER_MODULES = 16  # every folder, the top level (the hall) included: issue 45
MAX_FOLDER_LINES = 4000
MAX_FMT_SKIPS = 20
# A wing laid out along a flow: each module on a floor, every import within the wing pointing to a
# lower floor (ARCHITECTURE.md). Such a folder holds as many modules as its floors need.
FLOORS = {
    "train": {
        "step.objective": 1, "step.optimizers": 1, "step.adapters": 1, "step.distributed": 1,  # one step's pieces
        "data.dataset": 1, "memory": 1, "report.events": 1, "report.metrics": 1, "starting": 1,  # --init-lora
        "settings": 2,  # what a run asks for
        "workdir": 2,  # the work folder: its checks, its mark, its lock
        "config_file": 3, "state": 3,  # settings from a file; checkpoints
        "data.captions": 4, "data.latents": 4, "report.evaluation": 4, "report.samples": 4,  # caches; EMA; samples
        "plan": 5,  # everything checked before a model loads
        "trainer": 6,  # the run, step by step
        "command": 7,  # `train`
    },
}  # fmt: skip


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
    if name == "__init__":
        package = []
    elif path.name == "__init__.py":
        package = name.split(".")
    else:
        package = name.split(".")[:-1]
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
            # `from . import x` / `from .lora import apply`: the names may be modules themselves
            found.update(f"{target}.{a.name}" if target else a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("flux_klein_mlx.") for a in node.names if a.name.startswith("flux_klein_mlx.")
            )
    return {m for m in found if m in modules and m != name}


def package_imports() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source."""
    files = package_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def folder(module: str) -> str:
    """ "models.vae" -> "models"; a top-level module -> ""."""
    return module.rpartition(".")[0]


def in_models(module: str) -> bool:
    """A module of `models/` or of a sub-package of it (`models.flux3.transformer`): the networks' rules hold there."""
    return module.startswith("models.")


def test_models_import_only_models_and_errors():
    graph = package_imports()
    for module, imports in graph.items():
        if in_models(module):
            bad = {m for m in imports if not in_models(m) and m not in ("models", "errors")}
            assert not bad, f"{module}.py imports {sorted(bad)}: models/ may import only models/ and errors"


def test_nothing_reaches_into_a_wing_but_main():
    graph = package_imports()
    for module, imports in graph.items():
        if module == "__main__":
            continue
        for wing in WINGS:
            if (
                module == wing
                or module.startswith(wing + ".")
                or folder(module).split(".")[0] in WING_USERS.get(wing, ())
            ):
                continue
            bad = {m for m in imports if m == wing or m.startswith(wing + ".")}
            assert not bad, f"{module}.py imports {sorted(bad)}: only __main__ may import the {wing}/ wing"


def test_the_library_never_imports_a_command():
    graph = package_imports()
    for module, imports in graph.items():
        if module in COMMAND_MODULES or folder(module) in WINGS:
            continue  # commands and wings may use the command plumbing (cli)
        bad = imports & COMMAND_MODULES
        assert not bad, f"{module}.py (library) imports command module(s) {sorted(bad)}"


def test_the_server_imports_no_other_command():
    graph = package_imports()
    for module, imports in graph.items():
        if folder(module) == "serve":
            bad = imports & (COMMAND_MODULES - {"cli", "serve.command"})
            assert not bad, f"{module}.py (server) imports command module(s) {sorted(bad)}"


def test_no_import_cycles():
    graph = package_imports()
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep] if dep in path else [module, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_walker_sees_every_import_form():
    """The checks above are only as good as the walker: it must see every import form."""
    graph = package_imports()
    assert "run.loading" in graph["run.pipeline"]  # from .loading import ...
    assert "models.blocks" in graph["models.flux2.transformer"]  # from ..blocks import ... from a sub-package
    assert "errors" in graph["models.flux2.transformer"]  # from ...errors import ...
    assert "models.attention" in graph["models.flux3.transformer"]  # from ..attention import ... (a sub-package)
    assert "errors" in graph["models.flux3.transformer"]  # from ...errors import ...
    assert "run.pipeline" in graph["train.report.samples"]  # a function-local from ...run.pipeline import load
    assert "cli" in graph["generate"]


def test_main_names_every_command_module():
    """__main__ imports its commands by name (lazily): each name it gives must be a real module."""
    text = (PACKAGE / "__main__.py").read_text()
    modules = set(package_files())
    named = {part.removeprefix("flux_klein_mlx.") for part in text.split('"') if part.startswith("flux_klein_mlx.")}
    assert named, "no command modules found in __main__.py"
    assert named <= modules, sorted(named - modules)


def sources() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in package_files().items()}


def test_no_private_name_crosses_modules():
    """`from .x import _y` reaches into another module's internals: make the name public."""
    crossings = []
    for module, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("flux_klein_mlx")):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name != "__version__":
                        crossings.append(f"{module}: {alias.name}")
    assert not crossings, crossings


def test_no_function_over_60_lines():
    long = []
    for module, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines}")
    assert not long, long


def test_no_file_over_550_lines():
    big = {}
    for name, path in package_files().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            big[name] = lines
    assert not big, big


def test_folders_stay_small():
    """Every folder, the top level included and each of train/'s sub-folders apart, holds at most 16 modules
    and 4,000 lines: past that, a reader no longer sees its rooms (issue 45)."""
    modules: dict[str, int] = {}
    lines: dict[str, int] = {}
    for name, path in package_files().items():
        if name == "__init__":
            where = ""
        else:
            where = name if path.name == "__init__.py" else folder(name)
        lines[where] = lines.get(where, 0) + len(path.read_text().splitlines())
        if path.name != "__init__.py":
            modules[where] = modules.get(where, 0) + 1
    for where, count in modules.items():
        shown = f"{where.replace('.', '/')}/" if where else "the top level"
        assert count <= MAX_FOLDER_MODULES, (
            f"{shown} holds {count} modules (at most {MAX_FOLDER_MODULES}): split it by what its files do"
        )
        assert lines[where] <= MAX_FOLDER_LINES, f"{shown} holds {lines[where]} lines (at most {MAX_FOLDER_LINES})"


def room(module: str) -> str:
    """The room a module stands in: its folder's first part (`run.pipeline` -> `run`, `models.flux3.config`
    -> `models`), or the module itself at the top level (each module of the hall is a room of its own)."""
    return module.split(".")[0]


def test_no_circle_between_rooms():
    """No two rooms lean on each other, even through others: data flows one way (ARCHITECTURE.md). Before
    issue 45 the `upsample` command (then in upsample/, now `caption`) imported `inputs`, which imported
    `upsample/boxes.py`."""
    graph: dict[str, set[str]] = {}
    for module, imports in package_imports().items():
        graph.setdefault(room(module), set()).update(room(m) for m in imports if room(m) != room(module))
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("rooms in a circle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_every_arrow_in_a_floored_wing_points_down():
    graph = package_imports()
    for wing, floors in FLOORS.items():
        files = package_files()
        modules = {
            m.removeprefix(wing + ".") for m in graph if m.startswith(wing + ".") and files[m].name != "__init__.py"
        }
        assert modules == set(floors), (
            f"{wing}/: modules without a floor or floors without a module: {sorted(modules ^ set(floors))}"
        )
        for module in modules:
            for dep in graph[f"{wing}.{module}"]:
                if not dep.startswith(wing + ".") or dep.removeprefix(wing + ".") not in floors:
                    continue
                below = dep.removeprefix(wing + ".")
                assert floors[below] < floors[module], (
                    f"{wing}/{module}.py (floor {floors[module]}) imports {below} (floor {floors[below]}): "
                    "a module imports only lower floors"
                )


def test_fmt_skip_only_on_a_few_tables():
    count = sum(path.read_text().count("# fmt: skip") for path in package_files().values())
    assert count <= MAX_FMT_SKIPS, f"{count} '# fmt: skip' in the package (at most {MAX_FMT_SKIPS}, on data tables)"


def test_every_safe_write_lives_in_files_which_imports_only_errors():
    """files.py is the one home of temporary names, renames and links (issue 27): it imports only `errors`,
    and no other module renames, replaces or links a file itself."""
    assert package_imports()["storage.files"] == {"errors"}
    writers = []
    for module, tree in sources().items():
        for node in ast.walk(tree):
            if (
                module != "storage.files"
                and isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("replace", "rename", "link", "symlink")
            ):
                writers.append(f"{module}: os.{node.attr}")
            if module != "storage.files" and isinstance(node, ast.Attribute) and node.attr == "mkstemp":
                writers.append(f"{module}: mkstemp")
    assert not writers, writers


def string_constants(tree: ast.Module) -> str:
    """Every string literal of a module (f-strings' literal parts too), joined: what its messages say."""
    return "\n".join(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def test_the_generic_checkers_live_on_the_bottom_floor():
    """`checks` (is_int, check_whole, check_number, check_choice, check_prompt_given) imports only `errors`,
    so every floor may use it; no other module words "must be one of" or "the prompt is empty" (the
    `upsample` command, the CLI and the server refuse it alike; issue 45: the command reached into
    `inputs` for it) or cuts a list of names to the first few by hand."""
    assert package_imports()["checks"] == {"errors"}
    empty = [m for m, tree in sources().items() if "the prompt is empty" in string_constants(tree)]
    assert empty == ["checks"], f"{empty} refuse an empty prompt: use checks.check_prompt_given"
    by_hand = [m for m, tree in sources().items() if m != "checks" and " must be one of " in string_constants(tree)]
    assert not by_hand, f"{by_hand} word 'must be one of' themselves: use checks.check_choice"
    cut = [m for m, path in package_files().items() if '", ..." if len(' in path.read_text() and m != "errors"]
    assert not cut, f"{cut} list the first few names by hand: use errors.first_few"


def test_the_token_grid_is_computed_in_one_place():
    """16 px per latent token is `models/rope.PIXELS_PER_TOKEN` (with `token_grid`): no module divides,
    multiplies or takes the remainder by a literal 16 (`sampling`'s 16s are torch's normal_fill_16 blocks)."""
    ops = (ast.FloorDiv, ast.Mod, ast.Mult, ast.Div)
    literal = [
        f"{m}:{n.lineno}"
        for m, tree in sources().items()
        if m != "sampling"
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp)
        and isinstance(n.op, ops)
        and any(isinstance(side, ast.Constant) and side.value == 16 for side in (n.left, n.right))
    ]
    assert not literal, f"{literal} compute with a literal 16: use models/rope.PIXELS_PER_TOKEN or token_grid"


def test_the_default_dtype_is_named_once():
    """`dtypes.DEFAULT_DTYPE` is every default dtype (the commands' options, load, convert, the trainer, the
    benchmark): no other module spells "bfloat16" as a value."""
    spelled = [
        m
        for m, tree in sources().items()
        if m != "dtypes" and any(isinstance(n, ast.Constant) and n.value == "bfloat16" for n in ast.walk(tree))
    ]
    assert not spelled, f"{spelled} spell 'bfloat16': import dtypes.DEFAULT_DTYPE"


def test_no_constant_is_assigned_in_two_modules():
    """One home per fact: an upper-case module constant is defined once and imported where it is needed."""
    homes: dict[str, list[str]] = {}
    for module, tree in sources().items():
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in targets:
                if isinstance(target, ast.Name) and target.id.lstrip("_").isupper():
                    homes.setdefault(target.id, []).append(module)
    twice = {name: modules for name, modules in homes.items() if len(modules) > 1}
    assert not twice, twice


def test_every_folder_is_a_package_the_wheel_holds():
    """pyproject.toml names the packages one by one: a wing folder missing there is missing from a wheel."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser under its old name (a dependency there)
        import tomli as tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert folders == listed, sorted(folders ^ listed)


def outside_names(tree: ast.Module) -> set[str]:
    """The names a module binds by importing from outside the package (`import struct`, `from PIL import Image`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("flux_klein_mlx")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("flux_klein"):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_no_call_passes_six_values_by_position():
    """Values travel by name (issue 34): no call with six or more positional arguments builds one of the
    package's dataclasses or calls one of its functions (a third-party call such as `struct.pack` or
    `mx.reshape` is not ours to name)."""
    trees = sources()
    ours = set()  # the package's dataclasses and functions, by name
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                ours.add(node.name)
    by_position = []
    for module, tree in trees.items():
        outside = outside_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) < 6:
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in outside:
                continue
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ours and name not in outside:
                by_position.append(f"{module}:{node.lineno} {name}({len(node.args)} by position)")
    assert not by_position, by_position


# Wide functions left positional: the networks' forward passes (models/, the reference's own order) and the
# trainer's loss under `nn.value_and_grad` (it differentiates positional arguments).
WIDE_BY_POSITION = {("train.trainer", "loss")}


def test_a_wide_function_takes_the_rest_by_keyword():
    """A function of five or more parameters takes at most three of them by position (`*` after the first)."""
    wide = []
    for module, tree in sources().items():
        if in_models(module):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.args.vararg:
                continue
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(positional) + len(node.args.kwonlyargs) >= 5 and len(positional) > 3:
                if (module, node.name) not in WIDE_BY_POSITION:
                    wide.append(f"{module}.{node.name}({', '.join(positional)})")
    assert not wide, wide


# How a LoRA/LoKr file spells its tensors: only lora/ (the one writer and reader of adapter files) may.
FILE_KEY_SPELLINGS = ("lora_A", "lora_B", "lora_down", "lora_up", "lora.down", "lora.up", "lokr_w", "lokr_t", "hada_",
                      ".alpha", ".diff", "lora_adapter_metadata", "lora_unet_")  # fmt: skip


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of a module, its classes and functions (prose, not keys)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_only_lora_spells_a_lora_file_key():
    """Adapter files have one writer (lora/layouts.adapter_file) and one reader (lora/formats): no module
    outside lora/ holds a string (a literal or a piece of an f-string) that spells a file key."""
    found = []
    for module, tree in sources().items():
        if module == "lora" or module.startswith("lora."):
            continue
        prose = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                hits = [s for s in FILE_KEY_SPELLINGS if s in node.value]
                found += [f"{module}.py:{node.lineno}: {node.value!r}" for _ in hits[:1]]
    assert not found, found


def test_architecture_lists_the_floors_this_test_holds():
    """ARCHITECTURE.md's table of train/'s floors is FLOORS above, module for module (`step/objective` is
    `step.objective`): the document a newcomer reads cannot drift from the rule the build keeps."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = text.split("### train/'s floors", 1)[1].split("\n\n", 2)[1]
    listed = {}
    for row in table.splitlines()[2:]:  # past the header and its rule
        floor, modules = (cell.strip() for cell in row.strip("|").split("|"))
        listed.update({m.replace("/", "."): int(floor) for m in modules.split()})
    assert listed == FLOORS["train"]


# Who may name a family outside family/ and models/<family>/ (issue 45): each entry says why. A new family
# touches family/<x>/, models/<x>/, one row of family.FAMILIES and one FLOP entry; whatever else it must touch
# is listed here. Keep it short: a module here branches on a family by name, which the registry exists to avoid.
FAMILY_NAMERS = {
    "bench.flops": "the FLOP model of each family's networks (DENOISE_FLOPS, by Family.key)",
}
FAMILY_MODULES = ("family.flux2", "family.flux3", "models.flux2", "models.flux3")


def names_a_family(module: str, path: Path, imports: set[str]) -> list[str]:
    """What in one source file names a family: an import of a family's own module or of FLUX2 / FLUX3, a
    FAMILIES["..."] look-up, a "flux2" / "flux3" string."""
    found = sorted(m for m in imports if m.startswith(FAMILY_MODULES))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found += [a.name for a in node.names if a.name in ("FLUX2", "FLUX3")]
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "FAMILIES":
            found.append("FAMILIES[...]")
        elif isinstance(node, ast.Constant) and node.value in ("flux2", "flux3"):
            found.append(repr(node.value))
    return found


def test_only_a_family_names_a_family():
    """Outside family/ and models/<family>/, nothing defines or branches on a family: every question "which
    family is this folder / file / LoRA / params" is a loop over family.FAMILIES (it fails on 331f8cf: run.loading,
    run.components, convert, lora.names, lora.convert and others name FLUX2 / FLUX3 / "flux3")."""
    graph, files = package_imports(), package_files()
    mine = ("family", "models.flux2", "models.flux3")
    naming = {
        m: names_a_family(m, files[m], graph[m])
        for m in files
        if not (m == "family" or m.startswith(tuple(f"{p}." for p in mine))) and m not in FAMILY_NAMERS
    }
    naming = {m: n for m, n in naming.items() if n}
    assert not naming, f"{naming} name a family: ask family.FAMILIES (or a Family's attribute) instead"


def test_every_family_has_a_flop_count():
    """The FLOP table (bench/flops.DENOISE_FLOPS) is in step with the registry: one count per family, no other."""
    from flux_klein_mlx.bench.flops import DENOISE_FLOPS
    from flux_klein_mlx.family import FAMILIES

    assert set(DENOISE_FLOPS) == set(FAMILIES)
