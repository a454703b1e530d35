"""How many KV blocks fit: a memory budget divided by the bytes of one block across all layers.

A hybrid model's state slots (`cache_layout.py`, fixed in size per sequence) come out of the same budget first:
`max_batch_seqs` slots, plus the scratch slot, so that slots never bound the running set below `max_batch_seqs`;
the blocks get what they leave."""

from __future__ import annotations

from typing import NamedTuple


class KvGeometry(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    @property
    def bytes_per_block(self) -> int:  # (num_layers: the layers with a paged KV cache)
        # K and V, every layer.
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes


def blocks_for_budget(geometry: KvGeometry, budget_bytes: int, state_bytes: int = 0) -> int:
    """`state_bytes`: what the state slots take of the budget before the blocks."""
    return max(0, (budget_bytes - state_bytes) // geometry.bytes_per_block)


def profiled_budget(total_bytes: int, mem_fraction_static: float, used_after_profile_bytes: int) -> int:
    """vLLM's rule: the engine may use `mem_fraction_static` of the device; what the weights and the worst-case
    forward's activations took is subtracted, the rest is KV cache."""
    return int(total_bytes * mem_fraction_static) - used_after_profile_bytes
