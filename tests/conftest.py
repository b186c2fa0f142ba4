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
