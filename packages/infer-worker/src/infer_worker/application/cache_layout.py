"""The per-layer caches of a model, in layer order: paged KV for its full-attention layers, state-slot pools for
its linear-attention (Gated DeltaNet) layers — the hybrid cache.

A state slot is one sequence's fixed-size history in every linear-attention layer (a conv window and a recurrent
matrix per layer); it does not page. The scheduler hands out slots `1..num_state_slots` next to blocks; slot 0 is
the scratch slot of padding rows and of the start-up runs, so the pools hold `num_state_slots + 1` slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from infer_core.dtypes import DType
from infer_core.ports.backend import LlmBackend
from infer_worker.models.causal_lm import KvCaches
from infer_worker.models.spec import LINEAR_ATTENTION, ModelSpec

_FP32_BYTES = 4


class StateGeometry(NamedTuple):
    num_layers: int  # linear-attention layers
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_dtype_bytes: int  # the conv window is kept in the model dtype, the recurrent state in fp32

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * self.conv_dtype_bytes
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim * _FP32_BYTES
        return self.num_layers * (conv + recurrent)


def state_geometry(spec: ModelSpec, dtype: DType) -> StateGeometry | None:
    """None for a model without linear-attention layers (it needs no state slots)."""
    la = spec.linear_attention
    if la is None or not spec.num_state_layers:
        return None
    return StateGeometry(spec.num_state_layers, la.conv_dim, la.conv_kernel, la.num_v_heads, la.k_head_dim,
                         la.v_head_dim, dtype.itemsize)


class ModelCaches(NamedTuple):
    per_layer: KvCaches  # what the model's forward takes, one pair per layer
    state_pools: KvCaches  # the linear-attention layers' pairs alone (what a slot reset clears)


def allocate_caches(backend: LlmBackend, spec: ModelSpec, num_blocks: int, block_size: int, dtype: DType,
                    num_state_slots: int, num_kv_heads: int) -> ModelCaches:
    """Every layer's cache, with this rank's `num_kv_heads` (all of them without tensor parallelism);
    `num_state_slots` slots for sequences (plus scratch slot 0) when the model has state layers."""
    kv = iter(backend.allocate_kv_cache(spec.num_attention_layers, num_blocks, block_size, num_kv_heads,
                                        spec.head_dim, dtype))
    geometry = state_geometry(spec, dtype)
    pools: KvCaches = []
    if geometry is not None:
        gdn = backend.ops.gdn
        torch_dtype = backend.torch_dtype(dtype)
        assert isinstance(torch_dtype, torch.dtype)
        pools = gdn.allocate_state_pools(geometry.num_layers, num_state_slots + 1, geometry.conv_dim,
                                         geometry.conv_kernel, geometry.num_v_heads, geometry.k_head_dim,
                                         geometry.v_head_dim, torch_dtype)
    states = iter(pools)
    per_layer = [next(states) if kind == LINEAR_ATTENTION else next(kv) for kind in spec.mixers]
    return ModelCaches(per_layer, pools)
