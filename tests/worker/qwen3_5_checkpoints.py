"""Tiny random Qwen3.5 checkpoints in the published layout (`Qwen3_5ForConditionalGeneration`: the text model
under `model.language_model.`, a vision tower under `model.visual.`), written by transformers itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from infer_core.dtypes import DType
from infer_core.ports.backend import LlmBackend
from infer_worker.application.cache_layout import ModelCaches, allocate_caches
from infer_worker.infrastructure.model_loader import load_model
from infer_worker.models.causal_lm import CausalLM

TEXT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # [linear, linear, linear, full]: full_attention_interval 4, as published
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # a key head shared by 2 value heads, as published
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              num_position_embeddings=16)


def _vision(text: dict[str, Any]) -> dict[str, Any]:
    """The tower's merger projects into the text model's width, whatever hidden size a test picks."""
    return {**VISION, "out_hidden_size": text.get("hidden_size", TEXT["hidden_size"])}


def qwen3_5_config(**text: Any) -> Qwen3_5Config:
    return Qwen3_5Config(text_config={**TEXT, **text}, vision_config=_vision(text), tie_word_embeddings=True)


def qwen3_5_vl_config(image_pad: int, vision_start: int, vision_end: int, **text: Any) -> Qwen3_5Config:
    """The config with the vision tokens' ids (transformers finds an image by its start token and placeholders)."""
    return Qwen3_5Config(text_config={**TEXT, **text}, vision_config=_vision(text), tie_word_embeddings=True,
                         image_token_id=image_pad, vision_start_token_id=vision_start, vision_end_token_id=vision_end,
                         video_token_id=max(image_pad, vision_start, vision_end) + 1)


def random_qwen3_5(config: Qwen3_5Config, seed: int) -> Qwen3_5ForConditionalGeneration:
    """Random weights with every norm away from its identity ((1 + w) norms: w != 0; the gated norm: w != 1) and
    decays spread over their range, so a mis-mapped norm or gate cannot hide."""
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("norm.weight"):
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.01, 4).log())
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * torch.randn_like(param))
    return model


def write_qwen3_5(path: Path, seed: int = 0, **text: Any) -> Qwen3_5ForConditionalGeneration:
    model = random_qwen3_5(qwen3_5_config(**text), seed)
    model.save_pretrained(path, safe_serialization=True)
    return model


def load_hybrid(model_dir: Path, backend: LlmBackend, num_blocks: int, block_size: int, num_state_slots: int,
                dtype: DType = DType.FLOAT32) -> tuple[CausalLM, ModelCaches]:
    """The model and its per-layer caches (KV pages and state-slot pools) on `backend`."""
    model, spec = load_model(model_dir, backend, dtype, "auto", 0)
    return model, allocate_caches(backend, spec, num_blocks, block_size, dtype, num_state_slots, spec.num_kv_heads)
