"""Load a bench/ script, or a kernel script of the CUDA backend's scripts/, by path (neither folder is a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"
KERNEL_SCRIPTS = BENCH.parent / "packages" / "infer-backend-cuda" / "scripts"


def load_bench_script(name: str, folder: Path = BENCH) -> ModuleType:
    """Registered in sys.modules before it runs, as dataclasses need; its sibling imports (`from decode_roofline
    import ...`, as a script run from its folder has them) resolve from `folder`, appended to the path so that it
    shadows nothing installed."""
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    spec = importlib.util.spec_from_file_location(f"{folder.name}_{name}", folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
