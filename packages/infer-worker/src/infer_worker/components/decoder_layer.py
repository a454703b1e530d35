"""The pre-norm transformer block shared by the Llama family: norm -> attention -> add+norm -> MLP.

The residual stream is carried separately so that every residual addition fuses into the next norm."""

from __future__ import annotations

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_worker.components.attention import Attention, KvCache
from infer_worker.components.mlp import GatedMlp
from infer_worker.components.norm import RMSNorm
from infer_worker.components.weights import WeightSlots, prefixed


class DecoderLayer:
    def __init__(self, input_norm: RMSNorm, attention: Attention, post_attention_norm: RMSNorm, mlp: GatedMlp) -> None:
        self.input_norm = input_norm
        self.attention = attention
        self.post_attention_norm = post_attention_norm
        self.mlp = mlp

    def __call__(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: AttentionBatch, kv_cache: KvCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output and the residual stream *before* that output is added to it."""
        if residual is None:  # first layer: the embedding is the residual stream
            residual = hidden
            hidden = self.input_norm(hidden)
        else:
            hidden, residual = self.input_norm.add(hidden, residual)
        hidden = self.attention(hidden, batch, kv_cache)
        hidden, residual = self.post_attention_norm.add(hidden, residual)
        return self.mlp(hidden), residual

    def weight_slots(self) -> WeightSlots:
        """HF names relative to `model.layers.N.`."""
        return {
            **prefixed("input_layernorm.", self.input_norm.weight_slots()),
            **prefixed("self_attn.", self.attention.weight_slots()),
            **prefixed("post_attention_layernorm.", self.post_attention_norm.weight_slots()),
            **prefixed("mlp.", self.mlp.weight_slots()),
        }
