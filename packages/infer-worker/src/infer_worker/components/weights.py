"""Where a checkpoint tensor lands: a named slot over a model-owned tensor (or a row range of a fused one).

Components allocate their weights once, on the device and in the model dtype, and describe them as slots;
loading is then a name look-up plus an in-place copy (which also casts and moves), and a fused weight such as
qkv is just three slots over row ranges of one tensor.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, NamedTuple

import torch

from infer_worker.components.sharding import Shard

DUMMY_STD = 0.02  # HF's usual initializer_range: keeps activations of a random model in a sane range
# Random 4-bit codes around a zero point of 8 spread as U{-8..7}, whose std is ~4.61: the scale that gives DUMMY_STD.
AWQ_DUMMY_ZERO_WORD = 0x88888888 - (1 << 32)  # eight nibbles of 8, as the int32 the layout stores
AWQ_DUMMY_SCALE = DUMMY_STD / 4.61


class WeightInit(Enum):
    """How `load_format = "dummy"` fills a slot: the value family of the weight, not its exact values."""

    NORMAL = "normal"  # projections and embeddings
    ONES = "ones"  # norm scales
    ZEROS = "zeros"  # biases
    RANDOM_BITS = "random_bits"  # AWQ qweight: every 4-bit code equally likely
    AWQ_ZERO_POINT = "awq_zero_point"  # AWQ qzeros: the midpoint code
    AWQ_SCALE = "awq_scale"  # AWQ scales: DUMMY_STD over the codes' spread
    FP8_NORMAL = "fp8_normal"  # FP8 weight: N(0, 1) codes, well inside e4m3's range
    FP8_SCALE = "fp8_scale"  # FP8 weight_scale_inv: DUMMY_STD


class WeightSlot(NamedTuple):
    tensor: torch.Tensor  # the destination; a view into the parameter it belongs to
    init: WeightInit
    # Added to the checkpoint value at load (a load-time transform declared by the model's data): a (1 + w) norm
    # stores w, and the ordinary RMSNorm op then scales by the sum. Dummy weights are already the sum.
    offset: float = 0.0
    shard: Shard | None = None  # tensor parallelism: the slice of the checkpoint tensor this rank holds

    def load(self, name: str, value: torch.Tensor) -> None:
        if self.shard is not None and tuple(value.shape) != tuple(self.tensor.shape):
            value = self.shard.take(name, value)  # the whole tensor came: this rank's slice of it
        if tuple(value.shape) != tuple(self.tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(value.shape)}, the model expects {tuple(self.tensor.shape)}"
            )
        if _is_code(self.tensor.dtype) and value.dtype != self.tensor.dtype:
            # Packed ints and FP8 codes are bit patterns: a cast would load a different layout without a word.
            raise ValueError(
                f"weight {name!r} has dtype {value.dtype}, the quantized layout stores {self.tensor.dtype}"
            )
        self.tensor.copy_(value)
        if self.offset:
            self.tensor.add_(self.offset)

    def init_dummy(self, generator: torch.Generator) -> None:
        t, init = self.tensor, self.init
        if init is WeightInit.NORMAL:
            t.normal_(0.0, DUMMY_STD, generator=generator)
        elif init is WeightInit.ONES:
            t.fill_(1.0)
        elif init is WeightInit.RANDOM_BITS:
            size = t.element_size()
            raw = torch.randint(0, 256, (*t.shape[:-1], t.shape[-1] * size), dtype=torch.uint8, device=t.device,
                                generator=generator)
            t.copy_(raw.view(t.dtype))
        elif init is WeightInit.AWQ_ZERO_POINT:
            t.fill_(AWQ_DUMMY_ZERO_WORD)
        elif init is WeightInit.AWQ_SCALE:
            t.fill_(AWQ_DUMMY_SCALE)
        elif init is WeightInit.FP8_NORMAL:  # normal_ has no float8 kernel: draw in fp32, then round to e4m3
            t.copy_(torch.empty(t.shape, device=t.device).normal_(0.0, 1.0, generator=generator))
        elif init is WeightInit.FP8_SCALE:
            t.fill_(DUMMY_STD)
        else:
            t.zero_()


WeightSlots = dict[str, WeightSlot]


def prefixed(prefix: str, slots: Mapping[str, WeightSlot]) -> WeightSlots:
    """Qualify a component's slot names with its place in the checkpoint (`model.layers.3.mlp.` + ...)."""
    return {f"{prefix}{name}": slot for name, slot in slots.items()}


def sharded(slots: Mapping[str, WeightSlot], shard: Shard | None) -> WeightSlots:
    return {name: slot._replace(shard=shard) for name, slot in slots.items()}


def _is_code(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point or dtype.itemsize == 1


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
