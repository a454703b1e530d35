"""Qwen3 dense: the Llama decoder with per-head q/k RMSNorm (its spec sets `qk_norm`, so the attention
allocates and loads `q_norm`/`k_norm`) and, for the small sizes, tied embeddings. No code of its own."""

from __future__ import annotations

from infer_worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
