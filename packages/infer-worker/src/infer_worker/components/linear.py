"""Linear layers; the weight's layout (dense `[out, in]`, AWQ int4 or block FP8) is the weight's own data.

Each linear binds its scheme's ops from the backend once, at construction (`ops.linears.bind`), so calling one is
the same whatever the layout. `MergedLinear` stacks several checkpoint projections along the output dimension
(q/k/v, gate/up) so one GEMM computes them all; each part stays separately loadable through its slots.

Under tensor parallelism a linear's `Parallel` says which dimension its weight is split on and which collective
finishes its output (`components/sharding.py`); sizes given here are the whole model's, each rank allocates its
slice.
"""

from __future__ import annotations

from typing import Sequence

import torch

from infer_core.ports.op_ports import OpPorts
from infer_core.quant import DENSE, QuantMethod, QuantScheme
from infer_worker.components.linear_weight import LinearWeight
from infer_worker.components.sharding import Parallel, Shard, shard_of
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty, sharded


class Linear:
    def __init__(self, ops: OpPorts, weight: LinearWeight, bias: torch.Tensor | None = None,
                 parallel: Parallel = Parallel.REPLICATED) -> None:
        self._ops = ops.linears.bind(weight.scheme)
        self.params = weight
        self.bias = bias
        collective = ops.collective
        self.parallel = parallel if collective.world_size > 1 else Parallel.REPLICATED
        self._collective = collective
        self._shard = shard_of(self.parallel, collective.rank, collective.world_size)
        # A row-parallel bias is added once, after the partial sums are reduced.
        self._gemm_bias = None if self.parallel is Parallel.ROW else bias

    @classmethod
    def allocate(
        cls, ops: OpPorts, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: str,
        scheme: QuantScheme = DENSE, name: str = "", parallel: Parallel = Parallel.REPLICATED,
    ) -> "Linear":
        """`name` is the module's checkpoint path, for the message when `scheme` cannot hold this size."""
        in_features, out_features = _local(ops, scheme, parallel, name, in_features, out_features)
        weight = LinearWeight.allocate(scheme, in_features, (("", out_features),), dtype, device, owner=name)
        return cls(ops, weight, empty((out_features,), dtype, device) if bias else None, parallel)

    @property
    def scheme(self) -> QuantScheme:
        return self.params.scheme

    @property
    def weight(self) -> torch.Tensor:
        """The tensor the checkpoint calls `weight` (dense `[out, in]`, or FP8 codes); AWQ has none."""
        return self.params.tensors["weight"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(self._ops.linear(x, self.params.operands, self._gemm_bias))

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h = x + residual` (`x` when None); `(self(rms_norm(h)), h)`, fused where the backend can."""
        out, h = self._ops.add_rms_norm_linear(x, residual, norm_weight, eps, self.params.operands, self._gemm_bias)
        return self._finish(out), h

    def add_rms_norm_linear_silu_mul(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a `[gate | up]` weight: `(silu(gate) * up, h)` of `add_rms_norm_linear`, fused where the backend can."""
        act, h = self._ops.add_rms_norm_linear_silu_mul(x, residual, norm_weight, eps, self.params.operands,
                                                        self._gemm_bias)
        return self._finish(act), h

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.parallel is Parallel.ROW:
            out = self._collective.all_reduce(out)
            return out if self.bias is None else out + self.bias
        if self.parallel is Parallel.VOCAB:
            return self._collective.all_gather(out, dim=-1)
        return out

    def weight_slots(self) -> WeightSlots:
        slots = sharded(self.params.slots, self._shard)
        if self.bias is not None:
            slots["bias"] = WeightSlot(self.bias, WeightInit.ZEROS, shard=self._bias_shard)
        return slots

    @property
    def _bias_shard(self) -> Shard | None:
        """The output features' split; a row-parallel bias is whole on every rank."""
        return None if self.parallel is Parallel.ROW else self._shard


class MergedLinear(Linear):
    """Parts `(name, out_features)` concatenated along the output dimension, in order; all share one scheme."""

    def __init__(
        self,
        ops: OpPorts,
        in_features: int,
        parts: Sequence[tuple[str, int]],
        bias: bool,
        dtype: torch.dtype,
        device: str,
        scheme: QuantScheme = DENSE,
        owner: str = "",
        parallel: Parallel = Parallel.REPLICATED,
    ) -> None:
        """`parallel` COLUMN splits every part on its own (each rank holds its heads of q, k and v)."""
        parts = [(name, _local(ops, scheme, parallel, _qualified(owner, name), in_features, size)[1])
                 for name, size in parts]
        total = sum(size for _, size in parts)
        weight = LinearWeight.allocate(scheme, in_features, parts, dtype, device, owner=owner)
        super().__init__(ops, weight, empty((total,), dtype, device) if bias else None, parallel)
        self.parts = tuple(parts)
        self.part_sizes = tuple(size for _, size in parts)

    def weight_slots(self) -> WeightSlots:
        slots = sharded(self.params.slots, self._shard)
        if self.bias is not None:
            start = 0
            for name, size in self.parts:
                slots[f"{name}.bias"] = WeightSlot(self.bias[start : start + size], WeightInit.ZEROS,
                                                   shard=self._bias_shard)
                start += size
        return slots


def _qualified(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def _local(ops: OpPorts, scheme: QuantScheme, parallel: Parallel, owner: str, in_features: int,
           out_features: int) -> tuple[int, int]:
    """This rank's (in, out) features. AWQ's packed columns are not split; block FP8 splits on whole blocks
    (both refused at start-up first, from config.json)."""
    world = ops.collective.world_size if parallel is not Parallel.REPLICATED else 1
    if world == 1:
        return in_features, out_features
    if scheme.method is QuantMethod.AWQ:
        raise ValueError(f"{owner or 'a linear'}: AWQ weights cannot be split over tensor_parallel_size {world}")
    dim = parallel.shard_dim
    assert dim is not None  # every split layout names its dimension
    scheme.check_split(owner, (out_features, in_features)[dim], dim, world)
    return parallel.local_features(in_features, out_features, world, owner)
