"""Fixtures shared by the test modules: the tiny snapshots, built once per session, and a prompt
cache of each test's own (no test reads another's prompts, none touches the user's cache)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The support modules (tiny models, the references' runs, file-open tracing) import by their own names
# from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from command_line import run_cli  # noqa: E402
from families import KITS  # noqa: E402
from tiny_model import shared_tiny_snapshot  # noqa: E402

_SESSION_CACHE = tempfile.mkdtemp(prefix="flux-klein-test-cache-")


def pytest_configure(config):
    os.environ["FLUX_KLEIN_CACHE"] = _SESSION_CACHE  # also for session fixtures, before any test's own


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


# The files that take longest (pytest --durations, 2 cores), run first: the two workers of .ci/run then
# end together, instead of one finishing a long file picked up last while the other waits.
LONG_FILES = (  # by the seconds each took (--junitxml of the whole suite, 2 cores), longest first
    "test_serve.py",  # 81 s
    "test_distributed.py",  # 61
    "test_page_train.py",  # 56
    "test_objective.py",  # 55
    "test_finetune.py",  # 53
    "test_pipeline.py",  # 42
    "test_trainer.py",  # 31
    "test_workdir.py",  # 31
    "test_page.py",  # 31
    "test_samples.py",  # 27
    "test_evaluation.py",  # 23
    "test_kv.py",  # 22
    "test_upsample_doors.py",  # 22
    "test_page_boxes.py",  # 21
    "test_page_outpaint.py",  # 21
    "test_page_next.py",  # 20
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within a file, and among the other files, stays


@pytest.fixture(autouse=True)
def prompt_cache(tmp_path_factory, monkeypatch):
    """This test's prompt-embedding cache folder (empty at the start; `load()` uses it by default)."""
    folder = tmp_path_factory.mktemp("prompt-cache")
    monkeypatch.setenv("FLUX_KLEIN_CACHE", str(folder))
    return folder


@pytest.fixture(scope="session")
def distilled(tmp_path_factory):
    """The tiny distilled klein snapshot (diffusers layout, real Qwen3 tokenizer)."""
    return shared_tiny_snapshot(tmp_path_factory, distilled=True)


@pytest.fixture(scope="session")
def snapshot(distilled):
    return distilled


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """The tiny Base snapshot (no is_distilled key in model_index.json)."""
    return shared_tiny_snapshot(tmp_path_factory, distilled=False)


@pytest.fixture(scope="session")
def distilled3(tmp_path_factory):
    """The tiny distilled FLUX 3 Image Klein snapshot (flow map; modular layout)."""
    return KITS["flux3"].snapshot(tmp_path_factory, distilled=True)


@pytest.fixture(scope="session")
def base3(tmp_path_factory):
    """The tiny FLUX 3 Base snapshot."""
    return KITS["flux3"].snapshot(tmp_path_factory, distilled=False)


@pytest.fixture(scope="session", params=sorted(KITS))
def family(request):
    """The test kit of each family in turn (tests/support/families.py): a test that takes it runs for both."""
    return KITS[request.param]


@pytest.fixture(scope="session")
def family_distilled(family, request):
    """The family's tiny distilled snapshot (the same folder as `distilled` / `distilled3`)."""
    return request.getfixturevalue("distilled" if family.name == "flux2" else "distilled3")


@pytest.fixture(scope="session")
def family_base(family, request):
    """The family's tiny Base snapshot (the same folder as `base` / `base3`)."""
    return request.getfixturevalue("base" if family.name == "flux2" else "base3")


@pytest.fixture(scope="session")
def converted_snapshot(snapshot, tmp_path_factory):
    """The tiny distilled snapshot converted to our float32 folder (read only: tests copy it to change it)."""
    from flux_klein_mlx.convert import convert_model

    out = tmp_path_factory.mktemp("converted") / "conv"
    convert_model(snapshot, out, dtype="float32")
    return out


@pytest.fixture
def cli(capsys):
    """The command line in this process: `cli("generate", "--model", path, ...)` -> (exit code, stdout,
    stderr). Arguments may be paths or numbers; each call reads only its own output."""
    return lambda *args: run_cli(capsys, *args)


@pytest.fixture
def no_models(monkeypatch):
    """Record every model load of the pipeline; a bad input must be refused before any."""
    import flux_klein_mlx.run.pipeline as pipeline_module

    calls = []

    def recorder(info, name, *a, **k):
        calls.append(name)
        raise AssertionError(f"the {name} was loaded before the bad input was refused")

    monkeypatch.setattr(pipeline_module, "load_component", recorder)
    return calls


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The references run with one torch thread: torch's own pool and the preloaded OpenBLAS's threads
    (root conftest.py) oversubscribe a small machine's cores (measured ~10x slower torch forwards)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def tokenizers_built_once():
    """Each tokenizer is built once per session (transformers parses the 11 MB tokenizer.json in Python:
    ~1.3 s a load, and the suite loads the same files from many folders: snapshots, converted and
    quantized copies). Keyed by the folder's files' contents: a new or changed file runs the real
    loader, as does every subprocess; a failed load is never remembered."""
    from flux_klein_mlx.errors import FluxKleinError
    from flux_klein_mlx.models.tokenizer import PromptTokenizer, tokenizer_folder

    build = PromptTokenizer.from_folder.__func__
    built = {}

    def from_folder(cls, folder):
        try:
            files = tokenizer_folder(folder)  # the loader's own rule: tokenizer/, else text_encoder/
        except FluxKleinError:
            return build(cls, folder)  # the real loader's error
        contents = [
            (p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(files.iterdir()) if p.is_file()
        ]
        key = tuple(contents)
        if key not in built:
            built[key] = build(cls, folder)
        return built[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(PromptTokenizer, "from_folder", classmethod(from_folder))
    yield
    mp.undo()
