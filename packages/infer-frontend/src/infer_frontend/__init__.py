"""Optional browser console (chat + live engine metrics) for RustInfer.

It talks to the server over its public HTTP API only: the static page (``static_dir()``) calls ``/v1/*``,
``/metrics``, ``/metrics/system`` and ``/ready``. Two ways to serve it:

- the server mounts ``static_dir()`` at ``/`` when this package is installed (found through the entry-point
  group ``rustinfer.static``, so the server never imports this package);
- ``rustinfer-frontend --server URL`` serves the page and reverse-proxies the API to ``URL``
  (see :mod:`infer_frontend.proxy`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["static_dir"]

_STATIC = Path(__file__).resolve().parent / "static"


def static_dir() -> Path:
    """The directory holding ``index.html``, ``app.css`` and ``app.js`` (no build step)."""
    return _STATIC
