"""The op bundles of the CUDA adapter: cuBLAS math through torch, Triton fused ops, identity collective."""

from __future__ import annotations

import contextlib
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
# INFER_CUDA_MIXED_ATTENTION_STREAMS, a mixed step's attention on two streams (captured graphs hold the fork and
# join), so a small chunk's few prefill programs run under the decode kernel's KV stream instead of after it:
#   1: the prefill attention on a side stream beside the decode attention;
#   2: also the prefill rows' q/k norm, RoPE and store on the side stream, the decode rows' in the decode kernel (as in
#      a decode step), so the main stream runs a decode step's attention chain.
# 0: one stream. Default 2 (twenty-ninth session, H100, chat at qps 32 with the bounded prefill grid: ITL p50 / p99
# 6.72 / 8.86 against 6.82 / 9.40 ms on one stream). A/B runs; read once at import, like the other switches.
MIXED_STREAMS_ENV = "INFER_CUDA_MIXED_ATTENTION_STREAMS"
_MIXED_STREAMS_RAW = os.environ.get(MIXED_STREAMS_ENV, "2").strip() or "2"
if _MIXED_STREAMS_RAW not in ("0", "1", "2"):
    raise ValueError(f"{MIXED_STREAMS_ENV}={_MIXED_STREAMS_RAW!r}: 0, 1 or 2")
MIXED_STREAMS_MODE = int(_MIXED_STREAMS_RAW)
MIXED_STREAMS = MIXED_STREAMS_MODE >= 1


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """The stream a mixed step's prefill attention forks to: one per device, made at the first mixed step (a graph's
    warm-up runs before its capture, so never inside one)."""
    return torch.cuda.Stream(device_index)


class _ForkedStream:
    """Work in its `with` block goes to the device's side stream, after everything queued on the current one so
    far; `join` makes the current stream wait for it. Every tensor the side stream touches is allocated on the
    current stream, which joins before any of them can be freed for reuse. Not `enabled`, or on a CPU device (the
    interpreted kernels), the block runs in order on the current stream and `join` does nothing."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self._main = self._side = None
        self._context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if enabled and device.type == "cuda":
            self._main = torch.cuda.current_stream(device)
            self._side = _side_stream(device.index if device.index is not None else torch.cuda.current_device())
            self._side.wait_stream(self._main)
            self._context = torch.cuda.stream(self._side)

    def __enter__(self) -> None:
        self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)

    def join(self) -> None:
        if self._main is not None:
            self._main.wait_stream(self._side)


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
        rope = attention_decode.DecodeRope(
            k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, batch.slot_mapping
        )
        if batch.is_decode and attention_decode.FUSED_ROPE:
            return kernels.paged_attention_decode(
                q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale, rope=rope, output_gate=output_gate
            )
        if MIXED_STREAMS_MODE == 2 and attention_decode.FUSED_ROPE and output_gate is None:
            return self._mixed_on_two_streams(q, rope, k_cache, v_cache, batch, scale)
        return unfused_qk_norm_rope_attention(
            self, q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache, batch, scale,
            output_gate,
        )

    @staticmethod
    def _mixed_on_two_streams(
        q: torch.Tensor,
        rope: attention_decode.DecodeRope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        """A mixed step's attention with the chunk rows' q/k store and prefill attention on the side stream and the
        one-token rows' norm, RoPE, store and attention in one decode launch on this one. The two sides read the
        raw projection, write disjoint rows of `out` and of the caches (each sequence's new slots are its own), and
        `q_rot`'s chunk rows are written and read on the side stream only. CPU tensors (the interpreted kernels)
        run the same launches in order."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_rot = torch.empty(rope.k.shape, dtype=rope.k.dtype, device=q.device)
        fork = _ForkedStream(q.device)
        with fork:
            kernels.qk_norm_rope_store(
                q, rope.k, rope.v, rope.positions, rope.cos_sin_cache, rope.q_norm_weight, rope.k_norm_weight,
                rope.eps, k_cache, v_cache, rope.slot_mapping, q_out=q_rot, k_out=k_rot,
                skip_single_token_of=batch.query_start_loc,
            )
            kernels.paged_attention_prefill(
                q_rot, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                batch.max_query_len, scale, out=out, skip_single_token=True, max_chunk_seqs=batch.max_chunk_seqs,
            )
        kernels.paged_attention_decode(q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale, out=out,
                                       query_start_loc=batch.query_start_loc, rope=rope)
        fork.join()
        return out

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
        # The two kernels write disjoint rows of `out` and only read what the step stored before the fork.
        fork = _ForkedStream(q.device, enabled=MIXED_STREAMS)
        with fork:
            kernels.paged_attention_prefill(
                q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.max_query_len,
                scale, out=out, skip_single_token=True, max_chunk_seqs=batch.max_chunk_seqs,
            )
        kernels.paged_attention_decode(q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale, out=out,
                                       query_start_loc=batch.query_start_loc)
        fork.join()
        return out


class SingleDeviceCollective:
    """tp = 1: every collective is the identity."""

    world_size = 1
    rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x
