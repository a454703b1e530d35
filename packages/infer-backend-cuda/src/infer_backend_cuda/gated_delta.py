"""The `GatedDeltaOps` port (linear-attention layers of hybrid models) on Triton kernels.

Decode steps (every sequence one token) run the fused recurrent kernel, which is CUDA-graph capturable; other
steps the chunked (WY form) kernel. The state pools are allocated once, so a captured graph keeps addressing
the same slots.
"""

from __future__ import annotations

import torch

from infer_backend_cuda.kernels.causal_conv1d import causal_conv1d
from infer_backend_cuda.kernels.gdn_chunk import gdn_chunk
from infer_backend_cuda.kernels.gdn_gates import gated_rms_norm, gdn_gates
from infer_backend_cuda.kernels.gdn_recurrent import gdn_recurrent
from infer_core.ports.linear_attention import StateBatch


class CudaGatedDeltaOps:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def allocate_state_pools(
        self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
        k_head_dim: int, v_head_dim: int, conv_dtype: object,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(conv_dtype, torch.dtype)
        return [
            (
                torch.zeros((num_slots, conv_dim, conv_kernel - 1), dtype=conv_dtype, device=self.device),
                torch.zeros((num_slots, num_v_heads, k_head_dim, v_head_dim), dtype=torch.float32, device=self.device),
            )
            for _ in range(num_layers)
        ]

    def reset_slots(self, pools: list[tuple[torch.Tensor, torch.Tensor]], slot_ids: torch.Tensor) -> None:
        idx = slot_ids.to(device=self.device, dtype=torch.long)
        for conv, rec in pools:
            conv.index_fill_(0, idx, 0)
            rec.index_fill_(0, idx, 0)

    def causal_conv1d(
        self, x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, batch: StateBatch
    ) -> torch.Tensor:
        return causal_conv1d(x, weight, conv_states, batch.cu_seqlens, batch.slot_ids, batch.max_query_len)

    def gated_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        recurrent_states: torch.Tensor, batch: StateBatch,
    ) -> torch.Tensor:
        # Decode: one token per sequence, the recurrence is the whole work. Prefill / mixed steps: chunks of 64.
        if batch.is_decode:
            return gdn_recurrent(q, k, v, g, beta, recurrent_states, batch.cu_seqlens, batch.slot_ids)
        return gdn_chunk(q, k, v, g, beta, recurrent_states, batch.cu_seqlens, batch.slot_ids)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return gated_rms_norm(x, gate, weight, eps)

    def gdn_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn_gates(a, b, a_log, dt_bias)
