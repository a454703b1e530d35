"""A decoder layer's token mixer: what mixes information across positions (full attention over the paged KV
cache, or a Gated DeltaNet over a per-sequence state slot). The layer is the same around either; which one a layer
has is data (the model spec's `layer_types`)."""

from __future__ import annotations

from typing import Protocol

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.linear_attention import StateBatch
from infer_worker.components.linear import Linear
from infer_worker.components.weights import WeightSlots

# A layer's cache: (k_cache, v_cache) pages for attention, (conv_states, recurrent_states) slot pools for a GDN.
LayerCache = tuple[torch.Tensor, torch.Tensor]


class TokenMixer(Protocol):
    checkpoint_name: str  # the module's name under `layers.N.` in the checkpoint (self_attn, linear_attn)

    @property
    def in_proj(self) -> Linear:
        """The input projection, which the decoder layer fuses with the norm before it."""
        ...

    def mix(self, projected: torch.Tensor, batch: AttentionBatch, cache: LayerCache,
            states: StateBatch | None) -> torch.Tensor:
        """Everything after `in_proj`: `[T, hidden]` out. `states` is the step's state-slot metadata (None when
        the model has no state layers)."""
        ...

    def weight_slots(self) -> WeightSlots: ...
