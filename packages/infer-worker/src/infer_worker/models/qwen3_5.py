"""Qwen3.5 (text): the shared decoder with its layers' mixers from `layer_types` (Gated DeltaNet and gated full
attention), partial rotary and (1 + w) norms, all data of the spec. What is its own is the checkpoint layout: the
published `Qwen3_5ForConditionalGeneration` keeps the text model under `model.language_model.` next to the vision
tower (`model.visual.`, loaded when config.json has a `vision_config`) and the multi-token-prediction head (`mtp.`,
never loaded); the text-only `Qwen3_5ForCausalLM` keeps it under `model.`."""

from __future__ import annotations

import re

from infer_worker.models.llama import LlamaForCausalLM


class Qwen3_5ForConditionalGeneration(LlamaForCausalLM):
    checkpoint_prefix = "model.language_model."
    foreign_weights = re.compile(r"^mtp\.")


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    foreign_weights = re.compile(r"^(model\.visual\.|mtp\.)")
