"""The guard for tests that need the `torch` extra (torch, transformers, safetensors,
ml_dtypes).

On a machine without the extra they skip (pytest.importorskip). Where the extra is meant
to be installed they must never skip silently: with MOE_REQUIRE_TORCH=1 (CI sets it) a
missing package is an import error, i.e. a failure; and a half-installed extra (torch
without transformers, say) is a failure everywhere.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

PACKAGES = ("torch", "transformers", "safetensors", "ml_dtypes")


def require_torch_extra() -> tuple[ModuleType, ModuleType]:
    """(torch, transformers), or skip the module where the extra is absent."""
    if os.environ.get("MOE_REQUIRE_TORCH") == "1":
        mods = [importlib.import_module(p) for p in PACKAGES]
        return mods[0], mods[1]
    torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")
    missing = []
    for p in PACKAGES[1:]:
        try:
            importlib.import_module(p)
        except ImportError:
            missing.append(p)
    if missing:
        pytest.fail(f"torch is installed but not the rest of the [torch] extra: {missing}", pytrace=False)
    return torch, importlib.import_module("transformers")
