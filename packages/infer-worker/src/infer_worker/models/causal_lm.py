"""What the runtime needs from a model, whatever its architecture."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.op_ports import OpPorts
from infer_worker.components.weights import WeightSlots
from infer_worker.models.spec import ModelSpec

# One pair per layer: (k_cache, v_cache) pages for a full-attention layer, (conv_states, recurrent_states) slot
# pools for a linear-attention one (`application/cache_layout.py` allocates them in layer order).
KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


class CausalLM(Protocol):
    spec: ModelSpec

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every checkpoint tensor into place by its HF name; raise on unexpected or missing names."""
        ...

    def weight_slots(self) -> WeightSlots:
        """Every checkpoint tensor name the model expects and where it lands (with the slice a rank holds)."""
        ...

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights of the right shapes and scale (load_format = "dummy")."""
        ...

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches: KvCaches,
                state_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Ragged batch of `T` tokens -> final hidden states `[T, hidden]`; writes this step's KV and states.
        `state_slots` `[B]` int32: each sequence's state slot, needed when the model has linear-attention layers."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> float32 logits `[N, vocab]`."""
        ...


class CausalLMClass(Protocol):
    def __call__(self, spec: ModelSpec, ops: OpPorts, dtype: torch.dtype, device: str) -> CausalLM: ...
