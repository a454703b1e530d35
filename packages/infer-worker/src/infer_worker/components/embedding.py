"""Token embedding table `[vocab, hidden]`; under tensor parallelism each rank holds a contiguous slice of the
vocabulary's rows, looks up the ids that fall in it (zeros for the others) and the ranks' rows are summed."""

from __future__ import annotations

import torch

from infer_core.ports.op_ports import OpPorts
from infer_worker.components.sharding import Parallel, shard_of, split
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty


class Embedding:
    def __init__(self, ops: OpPorts, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: str) -> None:
        self._math = ops.math
        self._collective = collective = ops.collective
        local = split(vocab_size, collective.world_size, "vocab_size")
        self.vocab_start = collective.rank * local
        self._shard = shard_of(Parallel.VOCAB, collective.rank, collective.world_size)
        self.weight = empty((local, hidden_size), dtype, device)

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._shard is None:
            return self._math.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        rows = self._math.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self._collective.all_reduce(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0))

    def weight_slots(self) -> WeightSlots:
        return {"weight": WeightSlot(self.weight, WeightInit.NORMAL, shard=self._shard)}
