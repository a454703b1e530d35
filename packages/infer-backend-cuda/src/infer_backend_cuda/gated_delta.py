"""The `GatedDeltaOps` port (linear-attention layers of hybrid models) on Triton kernels.

A decode step's mixer (`gated_delta_mix`: conv, gates, recurrence, gated norm) runs as one kernel
(`kernels/gdn_decode.py`; on the H200 the Qwen3.5-4B batch-1 step 2.633 ms against 2.758 with the three kernels,
docs/benchmarks.md); `INFER_CUDA_GDN_FUSED_DECODE=0` runs the three (conv, the recurrence computing its heads'
gates, gated norm) for A/B runs. In other steps the gated delta rule splits by row length on the device: rows
shorter than `SHORT_ROW` (decode rows of a mixed step) through the recurrent kernel, the others through the
chunked (WY form) kernels, in the same step and without a host sync.
The state pools are allocated once, so a captured graph keeps addressing the same slots.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from infer_backend_cuda.kernels.causal_conv1d import causal_conv1d
from infer_backend_cuda.kernels.gdn_chunk import CHUNK, gdn_chunk
from infer_backend_cuda.kernels.gdn_decode import arrival_counters, gdn_decode
from infer_backend_cuda.kernels.gdn_gates import gated_rms_norm, gdn_gates
from infer_backend_cuda.kernels.gdn_recurrent import gdn_recurrent, prepare_gdn_out
from infer_core.ports.linear_attention import GdnLayer, StateBatch, unfused_gated_delta_mix

# Rows of fewer tokens run the recurrence, longer ones the chunks. A chunk pads a row to 64 tokens and costs a
# chunk-local program plus one sequential step of four tf32x3 products with the state (a few us, ~2 MFLOP per
# state tile), while the recurrence costs one dependent token step (~1 us: a load, three reductions) per token;
# in a mixed step the recurrent launch runs before the chunked ones, so a quarter chunk bounds what its longest
# row adds (~16 token steps) to about one long row's chunk step. Decode rows (1) and speculative verification
# rows (a few tokens) always take the recurrence.
SHORT_ROW = CHUNK // 4

# INFER_CUDA_GDN_FUSED_DECODE=0: decode steps run the three kernels instead of the fused one (A/B benchmarks).
# Read once at import, like kernels/_common.PDL_ENV (and not under RUSTINFER_, the config loader's prefix).
FUSED_DECODE_ENV = "INFER_CUDA_GDN_FUSED_DECODE"


def fused_decode_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(FUSED_DECODE_ENV, "1").strip() != "0"


_FUSED_DECODE = fused_decode_wanted()


class CudaGatedDeltaOps:
    def __init__(self, device: torch.device | str, fused_decode: bool = _FUSED_DECODE) -> None:
        self.device = torch.device(device)
        self.fused_decode = fused_decode
        self._arrivals = torch.zeros(0, dtype=torch.int32, device=self.device)  # the fused decode's counters

    def allocate_state_pools(
        self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
        k_head_dim: int, v_head_dim: int, conv_dtype: object,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(conv_dtype, torch.dtype)
        # Before any graph is captured; value heads bound the key heads (each key head is read by >= 1).
        self._arrivals = arrival_counters(num_slots, num_v_heads, self.device)
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
        cu, slots = batch.cu_seqlens, batch.slot_ids
        if batch.is_decode:  # one token per sequence: the recurrence is the whole work
            return gdn_recurrent(q, k, v, g, beta, recurrent_states, cu, slots)
        # Each launch runs its own rows and its other programs exit; both run even when the host's
        # max_query_len says one has no rows, so that the start-up warm-up's short prefills compile the chunked
        # kernels' batch-size variants too (an idle launch costs a few us).
        out = prepare_gdn_out(q, k, v, g, beta, recurrent_states, cu, slots, None)
        gdn_recurrent(q, k, v, g, beta, recurrent_states, cu, slots, out, max_len=SHORT_ROW - 1)
        return gdn_chunk(q, k, v, g, beta, recurrent_states, cu, slots, out, min_len=SHORT_ROW)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return gated_rms_norm(x, gate, weight, eps)

    def gdn_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn_gates(a, b, a_log, dt_bias)

    def gated_delta_mix(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer: GdnLayer,
        conv_states: torch.Tensor, recurrent_states: torch.Tensor, batch: StateBatch,
    ) -> torch.Tensor:
        if batch.is_decode and self.fused_decode:  # one launch instead of three
            heads = (layer.num_k_heads, layer.k_head_dim, layer.num_v_heads, layer.v_head_dim)
            return gdn_decode(qkv, z, b, a, heads, layer.conv_weight, layer.a_log, layer.dt_bias, layer.norm_weight,
                              layer.norm_eps, conv_states, recurrent_states, batch.cu_seqlens, batch.slot_ids,
                              self._arrivals_for(batch.slot_ids.shape[0] * layer.num_k_heads))
        rule = self._decode_rule if batch.is_decode else None
        return unfused_gated_delta_mix(self, qkv, z, b, a, layer, conv_states, recurrent_states, batch, rule)

    def _arrivals_for(self, count: int) -> torch.Tensor:
        """The fused decode's counters (zero between launches), grown outside graph capture only: a capture
        must keep addressing the buffer its replays will find zero."""
        if self._arrivals.numel() < count:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"the fused GDN decode needs {count} arrival counters, {self._arrivals.numel()} "
                                   "were allocated before the graph capture")
            self._arrivals = torch.zeros(count, dtype=torch.int32, device=self.device)
        return self._arrivals

    @staticmethod
    def _decode_rule(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: GdnLayer,
        recurrent_states: torch.Tensor, batch: StateBatch,
    ) -> torch.Tensor:
        """The decode step's gates and delta rule in one launch: the gates computed inside the recurrence (the same
        values bit for bit), three launches a layer instead of four."""
        return gdn_recurrent(q, k, v, a, b, recurrent_states, batch.cu_seqlens, batch.slot_ids,
                             gates=(layer.a_log.contiguous(), layer.dt_bias.contiguous()))
