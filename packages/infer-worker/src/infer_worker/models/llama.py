"""The Llama-family decoder (Llama 2/3.x, SmolLM2, and with q/k norms present Qwen3).

This module owns the checkpoint layout: which HF tensor name lands in which component slot. What varies
between members of the family is data in the spec (qk-norm, tied embeddings, biases, rope scaling).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.op_ports import OpPorts
from infer_core.quant import ModuleQuant
from infer_worker.components.attention import Attention
from infer_worker.components.decoder_layer import DecoderLayer
from infer_worker.components.embedding import Embedding
from infer_worker.components.linear import Linear
from infer_worker.components.linear_weight import LinearWeight
from infer_worker.components.mlp import GatedMlp
from infer_worker.components.norm import RMSNorm
from infer_worker.components.rotary import cos_sin_cache
from infer_worker.components.sharding import Parallel
from infer_worker.components.weights import WeightSlots, prefixed
from infer_worker.models.causal_lm import KvCaches
from infer_worker.models.spec import ModelSpec

# Buffers some old checkpoints saved although they are recomputed from the config.
_DERIVED_BUFFERS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LM_HEAD = "lm_head.weight"


class LlamaForCausalLM:
    def __init__(self, spec: ModelSpec, ops: OpPorts, dtype: torch.dtype, device: str) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        rope = cos_sin_cache(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling, device)
        self.embed_tokens = Embedding(ops, spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = [self._layer(ops, rope, i) for i in range(spec.num_layers)]
        self.norm = RMSNorm(ops, spec.hidden_size, spec.rms_norm_eps, dtype, device)
        # Tied embeddings: the head *is* the embedding tensor, so there is nothing separate to load. The head and
        # the embedding stay dense in every quantized format.
        self.lm_head = (
            Linear(ops, LinearWeight.dense(self.embed_tokens.weight), parallel=Parallel.VOCAB)
            if spec.tie_word_embeddings
            else Linear.allocate(ops, spec.hidden_size, spec.vocab_size, False, dtype, device, parallel=Parallel.VOCAB)
        )
        self._slots = self.weight_slots()

    def _layer(self, ops: OpPorts, rope: torch.Tensor, index: int) -> DecoderLayer:
        spec, dtype, device = self.spec, self.dtype, self.device
        quant = ModuleQuant(spec.quantization, f"model.layers.{index}.")
        attention = Attention(
            ops, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rope,
            qk_norm=spec.qk_norm, bias=spec.attention_bias, norm_eps=spec.rms_norm_eps, dtype=dtype, device=device,
            quant=quant.within("self_attn."),
        )
        return DecoderLayer(
            RMSNorm(ops, spec.hidden_size, spec.rms_norm_eps, dtype, device),
            attention,
            RMSNorm(ops, spec.hidden_size, spec.rms_norm_eps, dtype, device),
            GatedMlp(ops, spec.hidden_size, spec.intermediate_size, spec.mlp_bias, dtype, device, quant.within("mlp.")),
        )

    # ------------------------------------------------------------------ weights

    def weight_slots(self) -> WeightSlots:
        """Every HF tensor name this model expects, and where it goes."""
        slots = {
            **prefixed("model.embed_tokens.", self.embed_tokens.weight_slots()),
            **prefixed("model.norm.", self.norm.weight_slots()),
        }
        for i, layer in enumerate(self.layers):
            slots.update(prefixed(f"model.layers.{i}.", layer.weight_slots()))
        if not self.spec.tie_word_embeddings:
            slots.update(prefixed("lm_head.", self.lm_head.weight_slots()))
        return slots

    def _ignored(self, name: str) -> bool:
        # A tied checkpoint may still carry a copy of the head; HF ignores it, and so do we.
        return bool(_DERIVED_BUFFERS.match(name)) or (self.spec.tie_word_embeddings and name == _LM_HEAD)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded: set[str] = set()
        for name, tensor in weights:
            if self._ignored(name):
                continue
            slot = self._slots.get(name)
            if slot is None:
                raise ValueError(f"unexpected weight {name!r} for {self.spec.architecture}")
            if name in loaded:
                raise ValueError(f"weight {name!r} appears twice in the checkpoint")
            slot.load(name, tensor)
            loaded.add(name)
        missing = sorted(self._slots.keys() - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint lacks weights for {self.spec.architecture}: {shown}")

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name in sorted(self._slots):  # a fixed order, so a seed always gives the same weights
            self._slots[name].init_dummy(generator)

    # ------------------------------------------------------------------ compute

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches: KvCaches) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, batch, kv_cache)
        assert residual is not None  # num_layers >= 1
        hidden, _ = self.norm.add(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).to(torch.float32)
