"""What the runtime needs from a model, whatever its architecture."""

from __future__ import annotations

from typing import Iterable, NamedTuple, Protocol

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.op_ports import OpPorts
from infer_worker.components.vision import VisionTower
from infer_worker.components.weights import WeightSlots
from infer_worker.models.spec import ModelSpec

# One pair per layer: (k_cache, v_cache) pages for a full-attention layer, (conv_states, recurrent_states) slot
# pools for a linear-attention one (`application/cache_layout.py` allocates them in layer order).
KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


class StepImages(NamedTuple):
    """What a step's image prompts add to its tokens (device tensors): the vision tower's embeddings of the
    placeholder rows, and the 3-D positions of the rows of prompts with images (multimodal RoPE)."""

    embed_rows: torch.Tensor  # [K] int64 step rows of image placeholders
    embeddings: torch.Tensor  # [K, hidden] their embeddings, in that order
    rope_rows: torch.Tensor  # [R] int64 step rows whose rotary angles come from 3-D positions
    rope_positions: torch.Tensor  # [3, R] int64 their (temporal, height, width) positions


class CausalLM(Protocol):
    spec: ModelSpec
    visual: VisionTower | None  # the vision tower (`spec.vision`), when the model has one

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
                state_slots: torch.Tensor | None = None, images: StepImages | None = None) -> torch.Tensor:
        """Ragged batch of `T` tokens -> final hidden states `[T, hidden]`; writes this step's KV and states.
        `state_slots` `[B]` int32: each sequence's state slot, needed when the model has linear-attention layers.
        `images`: the step's image embeddings and 3-D positions (a model with a vision tower)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> float32 logits `[N, vocab]`."""
        ...


class CausalLMClass(Protocol):
    def __call__(self, spec: ModelSpec, ops: OpPorts, dtype: torch.dtype, device: str) -> CausalLM: ...
