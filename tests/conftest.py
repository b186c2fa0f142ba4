"""Fixtures shared by the test modules: the tiny snapshots, built once per session, and a prompt
cache of each test's own (no test reads another's prompts, none touches the user's cache)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tiny_model import shared_tiny_snapshot

_SESSION_CACHE = tempfile.mkdtemp(prefix="flux-klein-test-cache-")


def pytest_configure(config):
    os.environ["FLUX_KLEIN_CACHE"] = _SESSION_CACHE  # also for session fixtures, before any test's own


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


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


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The references run with one torch thread: torch's own pool and the preloaded OpenBLAS's threads
    (root conftest.py) oversubscribe a small machine's cores (measured ~10x slower torch forwards)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
