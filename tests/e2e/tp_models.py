"""Tiny random Llama and Qwen3 checkpoints for the tensor-parallel tests, written with numpy + safetensors (no
torch or transformers in the test process), with the embedded model's real tokenizer; optionally split over
several safetensors files with a `model.safetensors.index.json`, as the Hub publishes larger models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

VOCAB = 49152  # the embedded tokenizer's; divides by 2, 3 and 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class Shape(NamedTuple):
    architecture: str  # LlamaForCausalLM or Qwen3ForCausalLM (q/k norms)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    hidden: int = 64
    layers: int = 2
    vocab: int = VOCAB
    bias: bool = False  # attention_bias and mlp_bias: every projection has one


def write_checkpoint(path: Path, tokenizer_dir: Path | None, shape: Shape, seed: int, files: int = 1,
                     config_overrides: dict[str, Any] | None = None) -> Path:
    """N(0, 0.5) projections and non-unit norm scales: logits spread widely, so greedy picks are no near-ties
    that the ranks' different summation order could flip."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    hidden, q_size, kv_size = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def normal(*dims: int) -> np.ndarray:
        return rng.normal(0.0, 0.5, size=dims).astype(np.float32)

    def scale(n: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.2, size=n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(shape.vocab, hidden), "model.norm.weight": scale(hidden)}
    if not shape.tied:
        tensors["lm_head.weight"] = normal(shape.vocab, hidden)
    qwen3 = shape.architecture == "Qwen3ForCausalLM"
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": scale(hidden),
            p + "post_attention_layernorm.weight": scale(hidden),
            p + "self_attn.q_proj.weight": normal(q_size, hidden),
            p + "self_attn.k_proj.weight": normal(kv_size, hidden),
            p + "self_attn.v_proj.weight": normal(kv_size, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_size),
            p + "mlp.gate_proj.weight": normal(shape.intermediate, hidden),
            p + "mlp.up_proj.weight": normal(shape.intermediate, hidden),
            p + "mlp.down_proj.weight": normal(hidden, shape.intermediate),
        }
        if shape.bias:
            sizes = {"self_attn.q_proj": q_size, "self_attn.k_proj": kv_size, "self_attn.v_proj": kv_size,
                     "self_attn.o_proj": hidden, "mlp.gate_proj": shape.intermediate,
                     "mlp.up_proj": shape.intermediate, "mlp.down_proj": hidden}
            tensors |= {f"{p}{name}.bias": normal(size) for name, size in sizes.items()}
        if qwen3:
            tensors |= {p + "self_attn.q_norm.weight": scale(shape.head_dim),
                        p + "self_attn.k_norm.weight": scale(shape.head_dim)}
    path.mkdir(parents=True)
    _save(path, tensors, files, save_file)
    config = {
        "architectures": [shape.architecture], "model_type": "qwen3" if qwen3 else "llama", "vocab_size": shape.vocab,
        "hidden_size": hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": shape.tied, "attention_bias": shape.bias, "mlp_bias": shape.bias, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "float32",
    } | (config_overrides or {})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def _save(path: Path, tensors: dict[str, Any], files: int, save_file: Any) -> None:
    if files == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for k in range(files):
        shard = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = names[k::files]
        save_file({n: tensors[n] for n in part}, str(path / shard), metadata={"format": "pt"})
        weight_map |= {n: shard for n in part}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
