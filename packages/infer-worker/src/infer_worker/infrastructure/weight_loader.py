"""Streams the tensors of an HF safetensors checkpoint (single file or sharded with an index), by name.

Tensors are read one at a time from memory-mapped files, so peak host memory stays near one tensor, not
one checkpoint. Under tensor parallelism a rank reads only its slice of each split tensor (`slices`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol

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


class Slice(Protocol):
    """A rank's part of a tensor: `[start, end)` of one dimension (`components.sharding.Shard`)."""

    dim: int

    def bounds(self, full: int, name: str) -> tuple[int, int]: ...


def iter_safetensors(model_dir: Path, slices: Mapping[str, Slice] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor by name; a name in `slices` comes as that slice alone, read from the file without the rest."""
    slices = slices or {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                part = slices.get(name)
                if part is None:
                    yield name, handle.get_tensor(name)
                    continue
                view = handle.get_slice(name)
                shape = view.get_shape()
                start, end = part.bounds(shape[part.dim], name)
                yield name, view[tuple(slice(start, end) if d == part.dim else slice(None) for d in range(len(shape)))]
