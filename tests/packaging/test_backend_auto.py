"""`backend = "auto"` picks from what is installed and importable (macOS has no triton, so no CUDA backend)."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from infer_worker.infrastructure import backend_registry
from infer_worker.infrastructure.backend_registry import GROUP, BackendNotFoundError, resolve_backend_class


def _entry(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=GROUP)


def test_auto_skips_a_backend_whose_requirements_do_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {"cuda": _entry("cuda", "rustinfer_no_such_module:CudaBackend"),
             "cpu": _entry("cpu", "infer_backend_cpu:CpuBackend")}
    monkeypatch.setattr(backend_registry, "installed_backends", lambda: found)
    name, cls = resolve_backend_class("auto")
    assert name == "cpu" and cls.__name__ == "CpuBackend"


def test_auto_names_why_each_installed_backend_is_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {"cuda": _entry("cuda", "rustinfer_no_such_module:CudaBackend")}
    monkeypatch.setattr(backend_registry, "installed_backends", lambda: found)
    with pytest.raises(BackendNotFoundError, match="rustinfer_no_such_module"):
        resolve_backend_class("auto")


def test_an_explicitly_named_backend_is_not_silently_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {"cpu": _entry("cpu", "infer_backend_cpu:CpuBackend")}
    monkeypatch.setattr(backend_registry, "installed_backends", lambda: found)
    with pytest.raises(BackendNotFoundError, match="unknown backend 'cuda'"):
        resolve_backend_class("cuda")
