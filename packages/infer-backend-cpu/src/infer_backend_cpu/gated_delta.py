"""Reference Gated DeltaNet ops (`GatedDeltaOps`): pure torch, one sequence at a time for prefill and one
vectorised step for a decode batch.

Prefill runs the gated delta rule in its chunked WY form (the UT transform turns a chunk's delta-rule updates
into two triangular solves and a few matmuls); decode runs the per-token recurrence. Both equal the plain
per-token recurrence up to fp32 rounding, which is what the tests hold them to (and to transformers' torch
fallbacks, the oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer_core.ports.linear_attention import GdnLayer, StateBatch, unfused_gated_delta_mix

CHUNK = 64  # transformers' default chunk of the WY form
_L2_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised, q scaled by `Dk ** -0.5`, each key head repeated over the value heads it serves."""
    group = num_v_heads // q.shape[-2]
    q32 = _l2norm(q.to(torch.float32)).repeat_interleave(group, dim=-2)
    k32 = _l2norm(k.to(torch.float32)).repeat_interleave(group, dim=-2)
    return q32 * q.shape[-1] ** -0.5, k32


def _recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k `[B, H, Dk]`, v `[B, H, Dv]`, g, beta `[B, H]`, state `[B, H, Dk, Dv]` (fp32)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def _chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, heads first: q, k `[H, L, Dk]`, v `[H, L, Dv]`, g, beta `[H, L]`, state `[H, Dk, Dv]`.

    Zero padding to whole chunks is inert: a padded row has beta 0 (writes nothing) and g 0 (decays nothing)."""
    length = q.shape[1]
    pad = (-length) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, total = q.shape[0], q.shape[1]
    n = total // CHUNK

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(heads, n, CHUNK, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)  # [H, N, C]: log decay from the chunk's start through each row
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + strictly-lower(k_beta k^T * decay)) is unit lower triangular: solving against it applies the chunk's
    # delta-rule updates in one go (the WY / UT transform).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1:]
    k_to_end = k * (last - cum).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state  # what the state does not already predict
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ v_new
        state = state * last[:, i, :, None].exp() + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, total, -1)[:, :length], state


class CpuGatedDeltaOps:
    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def allocate_state_pools(
        self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
        k_head_dim: int, v_head_dim: int, conv_dtype: object,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(conv_dtype, torch.dtype)
        return [
            (torch.zeros((num_slots, conv_dim, conv_kernel - 1), dtype=conv_dtype, device=self.device),
             torch.zeros((num_slots, num_v_heads, k_head_dim, v_head_dim), dtype=torch.float32, device=self.device))
            for _ in range(num_layers)
        ]

    def reset_slots(self, pools: list[tuple[torch.Tensor, torch.Tensor]], slot_ids: torch.Tensor) -> None:
        index = slot_ids.to(torch.int64)
        for conv, recurrent in pools:
            conv[index] = 0
            recurrent[index] = 0

    def causal_conv1d(
        self, x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, batch: StateBatch
    ) -> torch.Tensor:
        w32 = weight.to(torch.float32)
        keep = weight.shape[1] - 1
        slots = batch.slot_ids.to(torch.int64)
        if batch.is_decode:
            window = torch.cat((conv_states[slots].to(torch.float32), x.to(torch.float32)[:, :, None]), dim=-1)
            conv_states[slots] = window[:, :, 1:].to(conv_states.dtype)
            return F.silu((window * w32).sum(dim=-1)).to(x.dtype)
        out = torch.zeros_like(x)  # rows of no sequence (a padded graph step's) stay zero
        bounds = batch.cu_seqlens.tolist()
        for i, slot in enumerate(slots.tolist()):
            begin, end = bounds[i], bounds[i + 1]
            if end == begin:
                continue
            window = torch.cat((conv_states[slot].to(torch.float32), x[begin:end].to(torch.float32).T), dim=-1)
            conv = F.conv1d(window[None], w32[:, None, :], groups=w32.shape[0])[0]  # [C, L]: one per new row
            out[begin:end] = F.silu(conv).T.to(x.dtype)
            conv_states[slot] = window[:, -keep:].to(conv_states.dtype)
        return out

    def gated_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        recurrent_states: torch.Tensor, batch: StateBatch,
    ) -> torch.Tensor:
        q32, k32 = _prepare_qk(q, k, v.shape[-2])
        v32, g32, beta32 = v.to(torch.float32), g.to(torch.float32), beta.to(torch.float32)
        slots = batch.slot_ids.to(torch.int64)
        if batch.is_decode:
            out, state = _recurrent_step(q32, k32, v32, g32, beta32, recurrent_states[slots])
            recurrent_states[slots] = state
            return out.to(v.dtype)
        out = torch.zeros_like(v32)
        bounds = batch.cu_seqlens.tolist()
        for i, slot in enumerate(slots.tolist()):
            begin, end = bounds[i], bounds[i + 1]
            if end == begin:
                continue
            heads_first = [x[begin:end].transpose(0, 1) for x in (q32, k32, v32, g32, beta32)]
            o, recurrent_states[slot] = _chunked(*heads_first, recurrent_states[slot])
            out[begin:end] = o.transpose(0, 1)
        return out.to(v.dtype)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
        return ((weight * normed) * F.silu(gate.to(torch.float32))).to(x.dtype)

    def gdn_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = -a_log.to(torch.float32).exp() * F.softplus(a.to(torch.float32) + dt_bias)
        return g, torch.sigmoid(b).to(torch.float32)

    def gated_delta_mix(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer: GdnLayer,
        conv_states: torch.Tensor, recurrent_states: torch.Tensor, batch: StateBatch,
    ) -> torch.Tensor:
        return unfused_gated_delta_mix(self, qkv, z, b, a, layer, conv_states, recurrent_states, batch)
