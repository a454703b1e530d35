"""Gated DeltaNet (Qwen3.5's linear attention) as a token mixer over per-sequence state slots.

One GEMM computes the four input projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, fused with
the norm before it); then the causal depthwise conv + SiLU over q|k|v (its last `K - 1` inputs kept in the
sequence's conv slot), the decay g and beta from a/b, the gated delta rule (its state in the recurrent slot), the
gated RMSNorm with `silu(z)` (scaling by w), and `out_proj`. Everything between the two GEMMs is one call of the
backend's `GatedDeltaOps.gated_delta_mix` (an adapter may fuse it; the CUDA one can, opt-in, at decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.linear_attention import GdnLayer, StateBatch
from infer_core.ports.op_ports import OpPorts
from infer_core.quant import DENSE_CONFIG, ModuleQuant
from infer_worker.components.linear import Linear, MergedLinear
from infer_worker.components.mixer import LayerCache
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty, prefixed

_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


@dataclass(frozen=True, slots=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers' geometry (Qwen3.5's `linear_*` config keys)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v together."""
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet:
    checkpoint_name = "linear_attn"

    def __init__(
        self, ops: OpPorts, hidden_size: int, geometry: LinearAttentionSpec, norm_eps: float, dtype: torch.dtype,
        device: str, quant: ModuleQuant = ModuleQuant(DENSE_CONFIG),
    ) -> None:
        self._gdn = ops.gdn
        self.geometry = g = geometry
        self.norm_eps = norm_eps
        sizes = (g.conv_dim, g.value_dim, g.num_v_heads, g.num_v_heads)
        self.in_proj_parts = MergedLinear(
            ops, hidden_size, tuple(zip(_IN_PROJ, sizes)), False, dtype, device, quant.fused_scheme(_IN_PROJ),
            quant.name(""),
        )
        self.out_proj = Linear.allocate(
            ops, g.value_dim, hidden_size, False, dtype, device, quant.scheme("out_proj"), quant.name("out_proj")
        )
        self.conv_weight = empty((g.conv_dim, 1, g.conv_kernel), dtype, device)  # the checkpoint's Conv1d layout
        self.a_log = empty((g.num_v_heads,), dtype, device)
        self.dt_bias = empty((g.num_v_heads,), dtype, device)
        self.norm_weight = empty((g.v_head_dim,), dtype, device)
        # The loader copies the checkpoint into these tensors in place, so the views stay the layer's weights.
        self._layer = GdnLayer(g.num_k_heads, g.k_head_dim, g.num_v_heads, g.v_head_dim, self.conv_weight[:, 0, :],
                               self.a_log, self.dt_bias, self.norm_weight, norm_eps)

    @property
    def in_proj(self) -> Linear:
        return self.in_proj_parts

    def mix(self, projected: torch.Tensor, batch: AttentionBatch, cache: LayerCache,
            states: StateBatch | None) -> torch.Tensor:
        if states is None:
            raise ValueError("a Gated DeltaNet layer needs the step's state slots (StateBatch)")
        conv_states, recurrent_states = cache
        qkv, z, b, a = projected.split(self.in_proj_parts.part_sizes, dim=-1)
        out = self._gdn.gated_delta_mix(qkv, z, b, a, self._layer, conv_states, recurrent_states, states)
        return self.out_proj(out)

    def weight_slots(self) -> WeightSlots:
        return {
            **self.in_proj_parts.weight_slots(),
            **prefixed("out_proj.", self.out_proj.weight_slots()),
            "conv1d.weight": WeightSlot(self.conv_weight, WeightInit.NORMAL),
            "A_log": WeightSlot(self.a_log, WeightInit.NORMAL),
            "dt_bias": WeightSlot(self.dt_bias, WeightInit.ONES),
            "norm.weight": WeightSlot(self.norm_weight, WeightInit.ONES),
        }
