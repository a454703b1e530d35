"""Fused transformer ops and paged attention."""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

from infer_core.ports.tensor import Tensor


class AttentionBatch(NamedTuple):
    """Per-step attention metadata for a ragged batch of sequences (tokens flattened to `T` rows).

    Sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`; its context after this step is
    `seq_lens[i]` tokens (cached prefix + this step's new tokens), laid out in pages `block_tables[i]`.
    """

    positions: Tensor  # [T] int64, absolute position of each new token
    slot_mapping: Tensor  # [T] int64, KV slot (block_id * block_size + offset); -1 = write nothing (padding)
    query_start_loc: Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: Tensor  # [B] int32, context length of each sequence after this step (0 = padding row)
    block_tables: Tensor  # [B, max_blocks_per_seq] int32, -1 padded
    max_query_len: int
    max_seq_len: int
    is_decode: bool  # every sequence has exactly one new token (CUDA-graph eligible)
    block_size: int
    # [T, rotary_dim] float32 rotary rows `[cos | sin]` of this step's tokens, when they are not rows of the
    # model's table at `positions` (multimodal RoPE: 3-D positions of image prompts); None: the table's rows.
    rope_cos_sin: Tensor | None = None
    # At most this many sequences of the step have two query rows or more (None: any number): a captured mixed
    # graph's bound, which lets the prefill attention size its grid by the prompt chunks, not by every sequence.
    max_chunk_seqs: int | None = None


class FusedOps(Protocol):
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last dimension, computed in fp32 and cast back to `x.dtype`."""
        ...

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """`residual = x + residual; return rms_norm(residual), residual`."""
        ...

    def silu_and_mul(self, gate_up: Tensor) -> Tensor:
        """`[T, 2I]` -> `silu(gate) * up` `[T, I]` (gate is the first half)."""
        ...

    def sigmoid_gate_mul(self, x: Tensor, gate: Tensor) -> Tensor:
        """`x * sigmoid(gate)` for `x [T, H, D]` and `gate [T, H, D]` (any row and head strides, last dim
        contiguous: a view into a wider projection), each rounded to x's dtype as the two unfused ops round."""
        ...

    def add_rms_norm_linear(
        self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """`h = x + residual` (`x` itself when residual is None); returns `(linear(rms_norm(h)), h)`.

        A norm and the projection after it, as one op so that an adapter can fuse the norm into the GEMM's
        prologue where that pays (decode-size batches); the result equals the unfused ops up to rounding."""
        ...

    def qk_norm_rope_store(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        cos_sin_cache: Tensor,
        q_norm_weight: Tensor | None,
        k_norm_weight: Tensor | None,
        eps: float,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Per-head RMSNorm of q and k (when the weights are given, as in Qwen3), NeoX-style RoPE on q and k,
        then store k and v into the paged cache at `slot_mapping` (slot -1 writes nothing).

        q `[T, Hq, D]`, k/v `[T, Hkv, D]`, `cos_sin_cache` `[max_pos, R]` (cos in the first half, sin in the
        second), caches `[num_blocks, block_size, Hkv, D]`. Returns the rotated (q, k).

        Partial rotary is the table's width: with `R = rotary_dim < D` only the first R dims of each head rotate
        (NeoX halves within them, as HF's `apply_rotary_pos_emb` on `q[..., :R]`), dims R.. pass unchanged
        (Qwen3.5: R = 64 of D = 256). The q/k norm still covers all D dims.
        """
        ...

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: AttentionBatch, scale: float
    ) -> Tensor:
        """Causal attention of q `[T, Hq, D]` over each sequence's paged context (prefix + new tokens, already
        stored). Grouped-query: query head h reads KV head `h // (Hq // Hkv)`. Returns `[T, Hq, D]`."""
        ...

    def qk_norm_rope_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        cos_sin_cache: Tensor,
        q_norm_weight: Tensor | None,
        k_norm_weight: Tensor | None,
        eps: float,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: AttentionBatch,
        scale: float,
        output_gate: Tensor | None = None,
    ) -> Tensor:
        """`qk_norm_rope_store` (at `batch.slot_mapping`) then `paged_attention` of the rotated q, then with
        `output_gate` (`[T, Hq, D]`, Qwen3.5's gated attention) `sigmoid_gate_mul` of the result: an attention
        layer's work between its two projections, as one op so that an adapter can run it as one kernel where
        that pays (decode batches). Equals the ops up to rounding; `unfused_qk_norm_rope_attention` is its
        meaning."""
        ...


Linear = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


def unfused_add_rms_norm_linear(
    fused: FusedOps,
    linear: Linear,
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """`FusedOps.add_rms_norm_linear` as the separate ops it stands for: the CPU reference's meaning of the op, and
    an adapter's path where fusing does not pay."""
    if residual is None:
        return linear(fused.rms_norm(x, norm_weight, eps), weight, bias), x
    normed, stream = fused.add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), stream


def unfused_qk_norm_rope_attention(
    fused: FusedOps,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: AttentionBatch,
    scale: float,
    output_gate: Tensor | None = None,
) -> Tensor:
    """`FusedOps.qk_norm_rope_attention` as the separate ops it stands for."""
    q, _ = fused.qk_norm_rope_store(
        q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache, batch.slot_mapping
    )
    out = fused.paged_attention(q, k_cache, v_cache, batch, scale)
    return out if output_gate is None else fused.sigmoid_gate_mul(out, output_gate)
