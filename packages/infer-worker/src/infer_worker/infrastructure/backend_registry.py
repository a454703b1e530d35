"""Finds compute backends through the `rustinfer.backends` entry point group (the worker never imports one)."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

from infer_core.dtypes import DType
from infer_core.ports.backend import LlmBackend

GROUP = "rustinfer.backends"
AUTO_PREFERENCE = ("cuda", "cpu")


class BackendNotFoundError(ValueError):
    pass


def installed_backends() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def _available(cls: Any) -> bool:
    """A backend class may say it cannot run here (e.g. CUDA without a GPU) through `available()`."""
    probe = getattr(cls, "available", None)
    return bool(probe()) if callable(probe) else True


def resolve_backend_class(name: str) -> tuple[str, Any]:
    found = installed_backends()
    if name == "auto":
        unusable = []
        for candidate in AUTO_PREFERENCE:
            if candidate not in found:
                continue
            try:
                cls = found[candidate].load()
            except ImportError as exc:  # installed, but a requirement is missing on this platform (triton on macOS)
                unusable.append(f"{candidate} ({exc})")
                continue
            if _available(cls):
                return candidate, cls
            unusable.append(f"{candidate} (not available here)")
        raise BackendNotFoundError(
            f"no usable backend among the installed ones: {sorted(found)}; " + "; ".join(unusable))
    if name not in found:
        raise BackendNotFoundError(
            f"unknown backend {name!r}; installed backends ({GROUP}): {', '.join(sorted(found)) or 'none'}"
        )
    return name, found[name].load()


def create_backend(name: str, device: str, dtype: DType | str = "auto") -> LlmBackend:
    """The backend `name` (or the first usable one for `auto`) on `device`, constructed as the port says:
    `Backend(device=..., dtype=...)`, where `dtype=None` (the config's `auto`) lets the backend choose; its
    `default_dtype()` then names the dtype it runs in."""
    _, cls = resolve_backend_class(name)
    return cls(device=device, dtype=None if dtype == "auto" else DType.parse(dtype))
