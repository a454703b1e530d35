"""Gated DeltaNet (linear attention) ops over a ragged batch, with per-sequence state slots.

A hybrid model's linear-attention layers keep no paged KV: each sequence owns one *state slot* per layer in two
fixed-size pools that the backend allocates once (`conv_states`, `recurrent_states`). The scheduler hands out slot
ids next to block ids; the worker zeroes a slot when a sequence is admitted (or recomputed after preemption) and
passes each row's slot id here. Slot 0 is reserved as scratch for padding rows (CUDA-graph batches padded to a
captured size): padding rows read and write slot 0 and nothing else.

Layout, as everywhere in the ports: tokens flattened to `T` rows; sequence `i` owns rows
`cu_seqlens[i]:cu_seqlens[i+1]`. A decode step is the same call with every length 1.

A layer's whole mixer between its two GEMMs is one call, `gated_delta_mix`, so that an adapter may fuse the chain
(the CUDA adapter can run a decode step as one kernel, opt-in); `unfused_gated_delta_mix` is that chain over the four
single ops, the definition every adapter's result equals.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

from infer_core.ports.tensor import Tensor


class StateBatch(NamedTuple):
    """Per-step state metadata for the linear-attention layers (shared by all of them in a step)."""

    cu_seqlens: Tensor  # [B + 1] int32, cumulative new-token counts (== AttentionBatch.query_start_loc)
    slot_ids: Tensor  # [B] int32, each sequence's state slot (0 = scratch, for padding rows)
    max_query_len: int
    is_decode: bool  # every sequence has exactly one new token (CUDA-graph eligible)


class GdnLayer(NamedTuple):
    """One Gated DeltaNet layer's geometry and the weights the mixer uses (all but the two GEMMs')."""

    num_k_heads: int
    k_head_dim: int
    num_v_heads: int
    v_head_dim: int
    conv_weight: Tensor  # [C, K], C = 2 * Hk * Dk + Hv * Dv (q | k | v channels)
    a_log: Tensor  # [Hv]
    dt_bias: Tensor  # [Hv]
    norm_weight: Tensor  # [Dv]
    norm_eps: float


class GatedDeltaOps(Protocol):
    def allocate_state_pools(
        self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
        k_head_dim: int, v_head_dim: int, conv_dtype: object,
    ) -> list[tuple[Tensor, Tensor]]:
        """Per linear-attention layer a zeroed `(conv_states, recurrent_states)` pair:
        conv `[num_slots, conv_dim, conv_kernel - 1]` in `conv_dtype` (the model dtype), recurrent
        `[num_slots, num_v_heads, k_head_dim, v_head_dim]` in fp32."""
        ...

    def reset_slots(self, pools: list[tuple[Tensor, Tensor]], slot_ids: Tensor) -> None:
        """Zero the given slots of every layer's pools (a sequence starts from no history)."""
        ...

    def causal_conv1d(
        self, x: Tensor, weight: Tensor, conv_states: Tensor, batch: StateBatch
    ) -> Tensor:
        """Causal depthwise conv (kernel `K = weight.shape[1]`, no bias) followed by SiLU, per sequence.

        x `[T, C]`, weight `[C, K]`. Sequence i's `K - 1` inputs before its first new row are
        `conv_states[slot_ids[i]]` (`[C, K - 1]`, oldest first); afterwards that slot holds the last `K - 1` inputs
        of the sequence so far (state and new rows together, so a 1-row step shifts by one). Returns `[T, C]` in
        x's dtype; the conv is computed in fp32, as transformers' `causal_conv1d_fn` / `_update` do for fp32
        weights."""
        ...

    def gated_delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, recurrent_states: Tensor,
        batch: StateBatch,
    ) -> Tensor:
        """The gated delta rule of transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`
        with `use_qk_l2norm_in_kernel=True`, per sequence, starting from and updating its slot's state in place.

        q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]` (value head h reads key head `h // (Hv // Hk)`), g (log decay, <= 0) and
        beta `[T, Hv]` fp32, recurrent_states `[S, Hv, Dk, Dv]` fp32. q and k are L2-normalised (eps 1e-6) and q is
        scaled by `Dk ** -0.5` inside. Per token: `S = S * exp(g)`, `S += k (beta (v - k^T S))^T`, `o = q^T S`,
        all in fp32. Returns o `[T, Hv, Dv]` in v's dtype. An adapter may chunk (the WY form) for prefill and run
        a fused recurrence for decode; the result equals the per-token recurrence up to fp32 rounding."""
        ...

    def gated_rms_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        """transformers' `Qwen3_5RMSNormGated` over the last dim: `(weight * rms_norm(x).to(x.dtype)) *
        silu(gate.float())`, cast to x's dtype. x, gate `[N, D]`, weight `[D]` (scales by w, not 1 + w)."""
        ...

    def gdn_gates(self, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
        """`(g, beta)` from the `in_proj_a` / `in_proj_b` outputs `[T, Hv]`:
        `g = -exp(A_log.float()) * softplus(a.float() + dt_bias)`, `beta = sigmoid(b).float()`; both fp32."""
        ...

    def gated_delta_mix(
        self, qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, layer: GdnLayer, conv_states: Tensor,
        recurrent_states: Tensor, batch: StateBatch,
    ) -> Tensor:
        """The mixer between in_proj and out_proj: `causal_conv1d` of qkv, split into q, k, v; `gdn_gates` of a, b;
        `gated_delta_rule`; `gated_rms_norm` of its output with gate z — exactly `unfused_gated_delta_mix`, up to
        fp32 rounding inside (the intermediate roundings to the model dtype kept).

        qkv `[T, C]`, z `[T, Hv * Dv]`, b, a `[T, Hv]`, all in the model dtype (row-strided views of the fused
        input projection allowed). Updates the batch's conv and recurrent slots; returns `[T, Hv * Dv]` in
        qkv's dtype."""
        ...


# The delta rule from the raw gate inputs: `(q, k, v, a, b, layer, recurrent_states, batch) -> out`.
GatedRule = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, "GdnLayer", Tensor, "StateBatch"], Tensor]


def gates_then_rule(
    ops: GatedDeltaOps, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, layer: GdnLayer,
    recurrent_states: Tensor, batch: StateBatch,
) -> Tensor:
    """The rule from raw `a` / `b` as the port's two single ops: the gates, then the delta rule."""
    decay, beta = ops.gdn_gates(a, b, layer.a_log, layer.dt_bias)
    return ops.gated_delta_rule(q, k, v, decay, beta, recurrent_states, batch)


def unfused_gated_delta_mix(
    ops: GatedDeltaOps, qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, layer: GdnLayer, conv_states: Tensor,
    recurrent_states: Tensor, batch: StateBatch, rule: GatedRule | None = None,
) -> Tensor:
    """`gated_delta_mix` as the chain of the port's four single ops; `rule` may stand for the middle two (an
    adapter's kernel that computes the gates inside the recurrence)."""
    num_tokens = qkv.shape[0]
    hk, dk, hv, dv = layer.num_k_heads, layer.k_head_dim, layer.num_v_heads, layer.v_head_dim
    mixed = ops.causal_conv1d(qkv, layer.conv_weight, conv_states, batch)
    q, k, v = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
    q, k, v = q.reshape(num_tokens, hk, dk), k.reshape(num_tokens, hk, dk), v.reshape(num_tokens, hv, dv)
    if rule is None:
        out = gates_then_rule(ops, q, k, v, a, b, layer, recurrent_states, batch)
    else:
        out = rule(q, k, v, a, b, layer, recurrent_states, batch)
    heads = num_tokens * hv
    out = ops.gated_rms_norm(out.reshape(heads, dv), z.reshape(heads, dv), layer.norm_weight, layer.norm_eps)
    return out.reshape(num_tokens, hv * dv)
