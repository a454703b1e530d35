"""Where a checkpoint tensor lands: a named slot over a model-owned tensor (or a row range of a fused one).

Components allocate their weights once, on the device and in the model dtype, and describe them as slots;
loading is then a name look-up plus an in-place copy (which also casts and moves), and a fused weight such as
qkv is just three slots over row ranges of one tensor.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, NamedTuple

import torch

DUMMY_STD = 0.02  # HF's usual initializer_range: keeps activations of a random model in a sane range


class WeightInit(Enum):
    """How `load_format = "dummy"` fills a slot: the value family of the weight, not its exact values."""

    NORMAL = "normal"  # projections and embeddings
    ONES = "ones"  # norm scales
    ZEROS = "zeros"  # biases


class WeightSlot(NamedTuple):
    tensor: torch.Tensor  # the destination; a view into the parameter it belongs to
    init: WeightInit

    def load(self, name: str, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self.tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(value.shape)}, the model expects {tuple(self.tensor.shape)}"
            )
        self.tensor.copy_(value)

    def init_dummy(self, generator: torch.Generator) -> None:
        if self.init is WeightInit.NORMAL:
            self.tensor.normal_(0.0, DUMMY_STD, generator=generator)
        elif self.init is WeightInit.ONES:
            self.tensor.fill_(1.0)
        else:
            self.tensor.zero_()


WeightSlots = dict[str, WeightSlot]


def prefixed(prefix: str, slots: Mapping[str, WeightSlot]) -> WeightSlots:
    """Qualify a component's slot names with its place in the checkpoint (`model.layers.3.mlp.` + ...)."""
    return {f"{prefix}{name}": slot for name, slot in slots.items()}


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
