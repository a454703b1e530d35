"""How many KV blocks fit: a memory budget divided by the bytes of one block across all layers."""

from __future__ import annotations

from typing import NamedTuple


class KvGeometry(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    @property
    def bytes_per_block(self) -> int:
        # K and V, every layer.
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes


def blocks_for_budget(geometry: KvGeometry, budget_bytes: int) -> int:
    return max(0, budget_bytes // geometry.bytes_per_block)


def profiled_budget(total_bytes: int, mem_fraction_static: float, used_after_profile_bytes: int) -> int:
    """vLLM's rule: the engine may use `mem_fraction_static` of the device; what the weights and the worst-case
    forward's activations took is subtracted, the rest is KV cache."""
    return int(total_bytes * mem_fraction_static) - used_after_profile_bytes
