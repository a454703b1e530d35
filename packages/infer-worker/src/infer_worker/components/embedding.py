"""Token embedding table `[vocab, hidden]`."""

from __future__ import annotations

import torch

from infer_core.ports.op_ports import OpPorts
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty


class Embedding:
    def __init__(self, ops: OpPorts, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: str) -> None:
        self._math = ops.math
        self.weight = empty((vocab_size, hidden_size), dtype, device)

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._math.embedding(token_ids, self.weight)

    def weight_slots(self) -> WeightSlots:
        return {"weight": WeightSlot(self.weight, WeightInit.NORMAL)}
