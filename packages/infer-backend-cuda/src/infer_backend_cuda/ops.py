"""The op bundles of the CUDA adapter: cuBLAS math through torch, Triton fused ops, identity collective."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from infer_backend_cuda import kernels
from infer_backend_cuda.kernels import attention_decode
from infer_backend_cuda.kernels import mid_gemm as mid
from infer_backend_cuda.kernels import skinny_gemm as skinny
from infer_core.ports.fused_ops import (
    AttentionBatch,
    unfused_add_rms_norm_linear,
    unfused_qk_norm_rope_attention,
)

GemmConfig = skinny.SkinnyConfig | mid.MidConfig
# INFER_CUDA_MIXED_ATTENTION_STREAMS=1: a mixed step's prefill attention runs on a side stream beside the decode
# attention (captured graphs hold the fork and join), so a small chunk's few prefill programs run under the decode
# kernel's KV stream instead of after it (A/B runs; read once at import, like the other switches).
MIXED_STREAMS_ENV = "INFER_CUDA_MIXED_ATTENTION_STREAMS"
MIXED_STREAMS = os.environ.get(MIXED_STREAMS_ENV, "0").strip() != "0"


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """The stream a mixed step's prefill attention forks to: one per device, made at the first mixed step (a graph's
    warm-up runs before its capture, so never inside one)."""
    return torch.cuda.Stream(device_index)


class CudaMathOps:
    """GEMMs via `torch.nn.functional.linear` (cuBLAS / cuBLASLt), except decode-size ones, which stream the weight
    through a Triton GEMM where this GPU's table measured it faster: the skinny GEMM at 1-8 rows
    (`kernels/skinny_gemm.py`), the mid GEMM at 9-128 rows and at 2-8 where the skinny one is not taken
    (`kernels/mid_gemm.py`); embedding gather and arg-max via torch."""

    def __init__(self, skinny_gemm: bool = True) -> None:
        self.skinny_gemm = skinny_gemm

    def triton_gemm_config(self, op: str, x: torch.Tensor, weight: torch.Tensor) -> GemmConfig | None:
        """The Triton GEMM's config when `op` on these operands should take it, else None (cuBLAS path): a skinny
        config at 1-8 rows, else a mid one at 2-128 (`linear` / `linear_silu_mul` only: at 2-8 rows where the skinny
        table left the shape to cuBLAS). fp32 stays on cuBLAS: the fp32 runs are the exact comparisons against the
        CPU reference."""
        if not (self.skinny_gemm and x.dim() == 2 and 1 <= x.shape[0] <= mid.MAX_M):
            return None
        if x.dtype == torch.float32 or x.stride(-1) != 1 or weight.stride(-1) != 1:
            return None
        m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
        if m <= skinny.MAX_M:
            config = skinny.choose_config("linear" if op == "linear_silu_mul" else op, m, n, k, x.device)
            if config is not None:
                return config
        return mid.choose_config(op, m, n, k, x.device) if op in mid.OPS else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear_with(self.triton_gemm_config("linear", x, weight), x, weight, bias)

    @staticmethod
    def linear_with(config: GemmConfig | None, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """`linear` with the Triton GEMM's config already chosen (`triton_gemm_config`; None: cuBLAS)."""
        if isinstance(config, mid.MidConfig):
            return mid.mid_linear(x, weight, bias, config=config)
        if config is not None:
            return skinny.skinny_linear(x, weight, bias, config=config)
        return F.linear(x, weight, bias)

    def embedding(self, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, weight)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, dim=-1)


class TritonFusedOps:
    """The `FusedOps` port on Triton kernels (see `kernels/`). Inputs are never modified; each op returns
    fresh tensors (the KV store writes only the caches). The norm+GEMM op runs as one skinny kernel at decode
    sizes where the tuned table says so, else as the norm kernel + `math.linear`."""

    def __init__(self, math: CudaMathOps) -> None:
        self._math = math

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(gate_up)

    def sigmoid_gate_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return kernels.sigmoid_gate_mul(x, gate)

    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config = self._math.triton_gemm_config("add_rms_norm_linear", x, weight)
        if config is not None and (residual is None or residual.stride(-1) == 1):
            return skinny.skinny_add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias, config=config)
        return unfused_add_rms_norm_linear(self, self._math.linear, x, residual, norm_weight, eps, weight, bias)

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

    def qk_norm_rope_attention(
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
        batch: AttentionBatch,
        scale: float,
        output_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A decode batch in one launch (`kernels/attention_decode.py`: the q/k norm, RoPE and store in the split
        pass, the split merge by its last program, the output gate where the output is written); a mixed one, or
        with the fusion off (`INFER_CUDA_FUSED_DECODE_ATTENTION=0`), the separate ops."""
        if batch.is_decode and attention_decode.FUSED_ROPE:
            rope = attention_decode.DecodeRope(
                k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, batch.slot_mapping
            )
            return kernels.paged_attention_decode(
                q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale, rope=rope, output_gate=output_gate
            )
        return unfused_qk_norm_rope_attention(
            self, q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache, batch, scale,
            output_gate,
        )

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, scale: float
    ) -> torch.Tensor:
        """A decode batch runs the split-KV decode kernel. A mixed one runs both kernels over the whole batch, each
        on its own sequences (chosen on the device, so a captured graph serves any mix): the decode kernel the
        one-token ones, whose one row would otherwise fill a 128-row prefill tile with a few rows, paying the
        full tile's tensor-core work for each of its K/V tiles; the prefill kernel all others."""
        if batch.is_decode:
            return kernels.paged_attention_decode(q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

        def prefill() -> None:
            kernels.paged_attention_prefill(
                q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.max_query_len,
                scale, out=out, skip_single_token=True,
            )

        def decode() -> None:
            kernels.paged_attention_decode(q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale, out=out,
                                           query_start_loc=batch.query_start_loc)

        if not (MIXED_STREAMS and q.is_cuda):
            prefill()
            decode()
            return out
        # The two kernels write disjoint rows of `out` and only read what the step stored before the fork. Every
        # tensor the side stream touches was allocated on this one, which waits for it before going on.
        main = torch.cuda.current_stream(q.device)
        side = _side_stream(q.device.index if q.device.index is not None else torch.cuda.current_device())
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefill()
        decode()
        main.wait_stream(side)
        return out


class SingleDeviceCollective:
    """tp = 1: every collective is the identity."""

    world_size = 1
    rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x
