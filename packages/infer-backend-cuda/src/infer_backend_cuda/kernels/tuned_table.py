"""Per-GPU tables of measured launch configs, `configs/<kernel>.json`: `{device name: [entry, ...]}`. The bench
scripts write them (`merge`); each kernel module turns this GPU's entries into its own keys and configs, once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Hashable

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def entries(path: Path, device_name: str) -> list[dict]:
    """This GPU's entries (none where the file or the GPU is missing)."""
    if not path.exists():
        return []
    return json.loads(path.read_text()).get(device_name, [])


def rows_shape_group(entry: dict) -> tuple[int, int, int, int]:
    """(row bucket, N, K, group): the quantized GEMMs' key of an entry."""
    return entry["m"], entry["n"], entry["k"], entry["group"]


def merge(path: Path, device_name: str, new: list[dict], key: Callable[[dict], Hashable]) -> None:
    """Replace this GPU's entries of the same keys by `new`, keep the others (and other GPUs'), sorted by key."""
    table = json.loads(path.read_text()) if path.exists() else {}
    kept = {key(e): e for e in table.get(device_name, [])}
    kept.update((key(e), e) for e in new)
    table[device_name] = [kept[k] for k in sorted(kept)]
    path.write_text(dumps(table))


def dumps(table: dict[str, list[dict]]) -> str:
    """The table as JSON with one entry a line (diffs of a re-tune stay readable)."""
    devices = (f" {json.dumps(name)}: [\n" + ",\n".join(f"  {json.dumps(e)}" for e in rows) + "\n ]"
               for name, rows in table.items())
    return "{\n" + ",\n".join(devices) + "\n}\n"
