"""Reference fused ops: written for clarity, one torch expression per step of the math.

Every other backend's kernels are tested against these, and these against plain torch/HF formulas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer_core.ports.fused_ops import (
    AttentionBatch,
    unfused_add_rms_norm_linear,
    unfused_qk_norm_rope_attention,
)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, cast back, then scale: the order HF's LlamaRMSNorm uses, so bf16 rounds the same way.
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of `x` `[T, H, D]`: the halves (x1, x2) rotate as (x1 cos - x2 sin, x2 cos + x1 sin).
    Computed in fp32 with `cos`/`sin` `[T, 1, D/2]`."""
    x32 = x.to(torch.float32)
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first `rotary_dim = 2 * cos.shape[-1]` dims of each head; the rest pass unchanged
    (partial rotary: the table's width says how many dims rotate)."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return _rope_neox(x, cos, sin)
    return torch.cat((_rope_neox(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def _store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter each token's k/v row into its slot of the paged cache; slot -1 (padding) writes nothing."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[valid].to(v_cache.dtype)


def context_slots(block_table_row: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """The cache slots holding tokens `0 .. context_len-1` of one sequence, in order `[context_len]`."""
    num_blocks = -(-context_len // block_size)
    blocks = block_table_row[:num_blocks].to(torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64, device=blocks.device)
    return (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:context_len]


def _attend_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last `Lq` tokens `q` `[Lq, Hq, D]` over the whole context `k`/`v` `[L, Hkv, D]`.

    Query row j sits at absolute position `L - Lq + j` (the cached prefix comes first), so it may see keys at
    positions `<= L - Lq + j`. Query head h reads KV head `h // (Hq // Hkv)` (grouped-query attention)."""
    query_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.to(torch.float32).repeat_interleave(group, dim=1)
    v = v.to(torch.float32).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), k) * scale
    query_pos = torch.arange(query_len, device=q.device)[:, None] + (context_len - query_len)
    key_pos = torch.arange(context_len, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


class CpuFusedOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return _rms_norm(residual, weight, eps), residual

    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_add_rms_norm_linear(self, F.linear, x, residual, norm_weight, eps, weight, bias)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def sigmoid_gate_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(gate)

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
        if q_norm_weight is not None:
            q = _rms_norm(q, q_norm_weight, eps)
        if k_norm_weight is not None:
            k = _rms_norm(k, k_norm_weight, eps)
        cos, sin = cos_sin_cache[positions].to(torch.float32)[:, None, :].chunk(2, dim=-1)
        q = _rope_partial(q, cos, sin)
        k = _rope_partial(k, cos, sin)
        _store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q, k

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
        return unfused_qk_norm_rope_attention(
            self, q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache, batch, scale,
            output_gate,
        )

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, scale: float
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        out = torch.zeros_like(q)  # rows of padding sequences stay zero
        starts = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        for i, context_len in enumerate(seq_lens):
            begin, end = starts[i], starts[i + 1]
            if context_len == 0 or end == begin:
                continue
            slots = context_slots(batch.block_tables[i], context_len, batch.block_size)
            out[begin:end] = _attend_one_sequence(q[begin:end], flat_k[slots], flat_v[slots], scale)
        return out
