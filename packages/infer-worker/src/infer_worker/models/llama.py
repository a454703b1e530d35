"""The Llama-family decoder (Llama 2/3.x, SmolLM2, and with q/k norms present Qwen3; with Gated DeltaNet layers
and gated attention, Qwen3.5).

This module owns the checkpoint layout: which HF tensor name lands in which component slot. What varies
between members of the family is data in the spec (qk-norm, tied embeddings, biases, rope scaling, each layer's
token mixer, partial rotary, the attention output gate, the norms' offset) and in the class attributes below
(where the text model sits in the checkpoint, what else the checkpoint holds).

A spec with a vision tower (`spec.vision`) builds it here and loads it from `vision_prefix`; `forward` then takes a
step's `StepImages`: the tower's embeddings replace the input embeddings of the image placeholder rows, and the
full-attention layers rotate the rows of prompts with images by their 3-D positions (`spec.mrope_section`).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.linear_attention import StateBatch
from infer_core.ports.op_ports import OpPorts
from infer_core.quant import ModuleQuant
from infer_worker.components.attention import Attention
from infer_worker.components.decoder_layer import DecoderLayer
from infer_worker.components.embedding import Embedding
from infer_worker.components.gated_delta_net import GatedDeltaNet
from infer_worker.components.linear import Linear
from infer_worker.components.linear_weight import LinearWeight
from infer_worker.components.mixer import TokenMixer
from infer_worker.components.mlp import GatedMlp
from infer_worker.components.mrope import mrope_cos_sin
from infer_worker.components.norm import RMSNorm
from infer_worker.components.rotary import cos_sin_cache, inverse_frequencies
from infer_worker.components.sharding import Parallel
from infer_worker.components.vision import VisionTower
from infer_worker.components.weights import WeightSlots, prefixed
from infer_worker.models.causal_lm import KvCaches, StepImages
from infer_worker.models.spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec

_LM_HEAD = "lm_head.weight"


class LlamaForCausalLM:
    # Where the text model's tensors sit in the checkpoint, and what else it may hold that is not ours to load
    # (buffers some old checkpoints saved although they are recomputed from the config).
    checkpoint_prefix = "model."
    foreign_weights = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
    vision_prefix = "model.visual."  # where a vision tower's tensors sit (a spec with `vision` has one)

    def __init__(self, spec: ModelSpec, ops: OpPorts, dtype: torch.dtype, device: str) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        rotary_dim = spec.rotary_dim or spec.head_dim
        rope = cos_sin_cache(rotary_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling, device)
        self.rope = rope
        self.inv_freq = inverse_frequencies(rotary_dim, spec.rope_theta, spec.rope_scaling).to(device)
        self.visual = self._vision_tower(ops)
        self.embed_tokens = Embedding(ops, spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = [self._layer(ops, rope, i) for i in range(spec.num_layers)]
        self.norm = self._norm(ops, spec.hidden_size)
        # Tied embeddings: the head *is* the embedding tensor, so there is nothing separate to load. The head and
        # the embedding stay dense in every quantized format.
        self.lm_head = (
            Linear(ops, LinearWeight.dense(self.embed_tokens.weight), parallel=Parallel.VOCAB)
            if spec.tie_word_embeddings
            else Linear.allocate(ops, spec.hidden_size, spec.vocab_size, False, dtype, device, parallel=Parallel.VOCAB)
        )
        self._slots = self.weight_slots()

    def _vision_tower(self, ops: OpPorts) -> VisionTower | None:
        vision = self.spec.vision
        if vision is None:
            return None
        if vision.out_hidden_size != self.spec.hidden_size:
            raise ValueError(f"the vision tower's out_hidden_size {vision.out_hidden_size} is not the text model's "
                             f"hidden_size {self.spec.hidden_size}")
        return VisionTower(ops, vision, self.dtype, self.device)

    def _norm(self, ops: OpPorts, size: int) -> RMSNorm:
        return RMSNorm(ops, size, self.spec.rms_norm_eps, self.dtype, self.device, self.spec.norm_offset)

    def _mixer(self, ops: OpPorts, rope: torch.Tensor, kind: str, quant: ModuleQuant) -> TokenMixer:
        spec, dtype, device = self.spec, self.dtype, self.device
        if kind == LINEAR_ATTENTION:
            assert spec.linear_attention is not None  # the spec parses it whenever a layer is linear
            return GatedDeltaNet(ops, spec.hidden_size, spec.linear_attention, spec.rms_norm_eps, dtype, device,
                                 quant.within("linear_attn."))
        assert kind == FULL_ATTENTION, kind
        return Attention(
            ops, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rope,
            qk_norm=spec.qk_norm, bias=spec.attention_bias, norm_eps=spec.rms_norm_eps, dtype=dtype, device=device,
            quant=quant.within("self_attn."), output_gate=spec.attention_output_gate, norm_offset=spec.norm_offset,
        )

    def _layer(self, ops: OpPorts, rope: torch.Tensor, index: int) -> DecoderLayer:
        spec = self.spec
        quant = ModuleQuant(spec.quantization, f"{self.checkpoint_prefix}layers.{index}.")
        return DecoderLayer(
            self._norm(ops, spec.hidden_size),
            self._mixer(ops, rope, spec.mixers[index], quant),
            self._norm(ops, spec.hidden_size),
            GatedMlp(ops, spec.hidden_size, spec.intermediate_size, spec.mlp_bias, self.dtype, self.device,
                     quant.within("mlp.")),
        )

    # ------------------------------------------------------------------ weights

    def weight_slots(self) -> WeightSlots:
        """Every HF tensor name this model expects, and where it goes."""
        prefix = self.checkpoint_prefix
        slots = {
            **prefixed(f"{prefix}embed_tokens.", self.embed_tokens.weight_slots()),
            **prefixed(f"{prefix}norm.", self.norm.weight_slots()),
        }
        for i, layer in enumerate(self.layers):
            slots.update(prefixed(f"{prefix}layers.{i}.", layer.weight_slots()))
        if not self.spec.tie_word_embeddings:
            slots.update(prefixed("lm_head.", self.lm_head.weight_slots()))
        if self.visual is not None:
            slots.update(prefixed(self.vision_prefix, self.visual.weight_slots()))
        return slots

    def _ignored(self, name: str) -> bool:
        # A tied checkpoint may still carry a copy of the head; HF ignores it, and so do we.
        return bool(self.foreign_weights.match(name)) or (self.spec.tie_word_embeddings and name == _LM_HEAD)

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
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches: KvCaches,
                state_slots: torch.Tensor | None = None, images: StepImages | None = None) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        states = None if state_slots is None else StateBatch(batch.query_start_loc, state_slots, batch.max_query_len,
                                                             batch.is_decode)
        hidden = self.embed(input_ids)
        if images is not None:
            hidden, batch = self._with_images(hidden, batch, images)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, batch, cache, states)
        assert residual is not None  # num_layers >= 1
        hidden, _ = self.norm.add(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings `[T, hidden]` of a step: where rows may be replaced by other embeddings (image
        features) before the first layer."""
        return self.embed_tokens(input_ids)

    def _with_images(self, hidden: torch.Tensor, batch: AttentionBatch,
                     images: StepImages) -> tuple[torch.Tensor, AttentionBatch]:
        """The placeholder rows' embeddings replaced by the tower's, and the rotary rows of the 3-D positions in
        place of the table rows of the tokens that have them."""
        if images.embed_rows.numel():
            hidden = hidden.index_copy(0, images.embed_rows, images.embeddings.to(hidden.dtype))
        if images.rope_rows.numel():
            if not self.spec.mrope_section:
                raise ValueError(f"{self.spec.architecture} has no mrope_section for 3-D positions")
            rows = self.rope.index_select(0, batch.positions)
            rows.index_copy_(0, images.rope_rows, mrope_cos_sin(images.rope_positions, self.inv_freq,
                                                                self.spec.mrope_section).to(rows.dtype))
            batch = batch._replace(rope_cos_sin=rows)
        return hidden, batch

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).to(torch.float32)
