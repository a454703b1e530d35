"""The op bundles of the CUDA adapter: cuBLAS math through torch, Triton fused ops, identity collective."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer_backend_cuda import kernels
from infer_backend_cuda.kernels import skinny_gemm
from infer_core.ports.fused_ops import AttentionBatch


class CudaMathOps:
    """GEMMs via `torch.nn.functional.linear` (cuBLAS / cuBLASLt), except decode-size ones (<= 8 rows), which
    stream the weight through the skinny Triton GEMM where it is faster (`kernels/skinny_gemm.py`);
    embedding gather and arg-max via torch."""

    def __init__(self, skinny_gemm: bool = True) -> None:
        self.skinny_gemm = skinny_gemm

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.skinny_gemm and x.dim() == 2 and 1 <= x.shape[0] <= skinny_gemm.MAX_M and x.dtype != torch.float32:
            config = skinny_gemm.choose_config(x.shape[0], weight.shape[0], weight.shape[1], x.device)
            if config is not None and x.stride(-1) == 1 and weight.stride(-1) == 1:
                return skinny_gemm.skinny_linear(x, weight, bias, config=config)
        return F.linear(x, weight, bias)

    def embedding(self, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, weight)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, dim=-1)


class TritonFusedOps:
    """The `FusedOps` port on Triton kernels (see `kernels/`). Inputs are never modified; each op returns
    fresh tensors (the KV store writes only the caches)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(gate_up)

    def qk_norm_rope_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.qk_norm_rope_store(
            q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache, slot_mapping
        )

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, scale: float
    ) -> torch.Tensor:
        if batch.is_decode:
            return kernels.paged_attention_decode(q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale)
        return kernels.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            batch.max_query_len,
            scale,
        )


class SingleDeviceCollective:
    """tp = 1: every collective is the identity."""

    world_size = 1
    rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x
