"""Plain math: GEMMs, embedding gather, argmax."""

from __future__ import annotations

from typing import Protocol

from infer_core.ports.tensor import Tensor


class MathOps(Protocol):
    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """`x @ weight.T (+ bias)`; weight is `[out_features, in_features]` as in HF checkpoints."""
        ...

    def embedding(self, token_ids: Tensor, weight: Tensor) -> Tensor:
        """Gather rows of `weight` `[vocab, hidden]` for `token_ids` `[T]` -> `[T, hidden]`."""
        ...

    def argmax(self, x: Tensor) -> Tensor:
        """Row-wise argmax of `[N, V]` -> `[N]` int64."""
        ...
