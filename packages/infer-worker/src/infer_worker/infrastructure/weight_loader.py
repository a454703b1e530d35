"""Streams the tensors of an HF safetensors checkpoint (single file or sharded with an index), by name.

Tensors are read one at a time from memory-mapped files, so peak host memory stays near one tensor, not
one checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from safetensors import safe_open

if TYPE_CHECKING:  # safe_open(framework="pt") imports torch itself; the file names are read without it
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightsNotFoundError(FileNotFoundError):
    pass


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files in a stable order: the index's shards, else model.safetensors, else any
    *.safetensors file in the directory."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        absent = [shard for shard in shards if not (model_dir / shard).is_file()]
        if absent:
            raise WeightsNotFoundError(f"{index} names shards that are not in {model_dir}: {', '.join(absent)}")
        return [model_dir / shard for shard in shards]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    raise WeightsNotFoundError(
        f"no safetensors weights in {model_dir} (expected {SINGLE_FILE} or {INDEX_FILE} with its shards)"
    )


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
