"""The pre-norm transformer block shared by the Llama family and the hybrids: norm -> token mixer -> add+norm ->
MLP. The mixer (full attention, or a Gated DeltaNet) is an attribute (`components/mixer.py`).

The residual stream is carried separately so that every residual addition fuses into the next norm, and each
norm is one op with the projection after it (`FusedOps.add_rms_norm_linear`); the MLP's norm also takes the
SiLU-and-mul after its gate / up GEMM (`LinearOps.add_rms_norm_linear_silu_mul`, an epilogue at decode sizes)."""

from __future__ import annotations

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.linear_attention import StateBatch
from infer_worker.components.mixer import LayerCache, TokenMixer
from infer_worker.components.mlp import GatedMlp
from infer_worker.components.norm import RMSNorm
from infer_worker.components.weights import WeightSlots, prefixed


class DecoderLayer:
    def __init__(self, input_norm: RMSNorm, mixer: TokenMixer, post_attention_norm: RMSNorm, mlp: GatedMlp) -> None:
        self.input_norm = input_norm
        self.mixer = mixer
        self.post_attention_norm = post_attention_norm
        self.mlp = mlp

    def __call__(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: AttentionBatch, cache: LayerCache,
        states: StateBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output and the residual stream *before* that output is added to it.
        `residual` is None at the first layer, where the embedding is the residual stream."""
        projected, residual = self.input_norm.project(hidden, residual, self.mixer.in_proj)
        hidden = self.mixer.mix(projected, batch, cache, states)
        act, residual = self.post_attention_norm.project_silu_mul(hidden, residual, self.mlp.gate_up_proj)
        return self.mlp.down_proj(act), residual

    def weight_slots(self) -> WeightSlots:
        """HF names relative to `model.layers.N.`."""
        return {
            **prefixed("input_layernorm.", self.input_norm.weight_slots()),
            **prefixed(f"{self.mixer.checkpoint_name}.", self.mixer.weight_slots()),
            **prefixed("post_attention_layernorm.", self.post_attention_norm.weight_slots()),
            **prefixed("mlp.", self.mlp.weight_slots()),
        }
