"""Every name `flux_klein_mlx` exports resolves (issue 45: `load_component` had moved and `__init__` still
mapped it to `loading`, so `from flux_klein_mlx import load_component` raised), each from the module that
defines it, and `dir()` lists them."""

from __future__ import annotations

import importlib

import pytest

import flux_klein_mlx


@pytest.mark.parametrize("name", flux_klein_mlx.__all__)
def test_every_exported_name_resolves(name):
    value = getattr(flux_klein_mlx, name)
    assert value is not None
    exec(f"from flux_klein_mlx import {name}", {})  # the form docs/python.md shows


def test_the_lazy_table_names_modules_that_define_their_names():
    for name, module in flux_klein_mlx._EXPORTS.items():
        assert name in vars(importlib.import_module(f"flux_klein_mlx.{module}")), (name, module)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Progress'"):
        flux_klein_mlx.Progress  # noqa: B018  (an alias for a release that never existed, dropped)
