"""Plain math on torch's CPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CpuMathOps:
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def embedding(self, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, weight)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, dim=-1)
