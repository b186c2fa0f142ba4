"""Fixtures shared by the test modules: the tiny snapshots, built once per session."""

from __future__ import annotations

import pytest

from tiny_model import shared_tiny_snapshot


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
