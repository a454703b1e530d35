"""Convert a llama-architecture GGUF file into a standard Hugging Face model directory (float32 safetensors).

Pure numpy: `gguf.quants.dequantize` expands F32/Q4_1/Q8_0/... blocks, so no torch is needed here. Two
llama.cpp conventions have to be undone: tensor names (llama.cpp's `blk.N.attn_q` -> HF's
`model.layers.N.self_attn.q_proj`) and the row permutation llama.cpp applies to the q/k projections for its
RoPE layout (interleaved pairs instead of HF's rotate-half halves). Forgetting the latter still loads fine and
then the model talks nonsense.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from infer_worker.infrastructure.gguf_tokenizer import GgufTokenizerSpec, build_tokenizer, tokenizer_config

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset({"llama"})

# llama.cpp tensor name -> HF LlamaForCausalLM name; `{i}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters the conversion itself needs (head counts for the q/k un-permutation)."""

    num_heads: int
    num_kv_heads: int


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as Python values. Arrays of tokens/merges are kept as lists (they are needed)."""
    return {name: field.contents() for name, field in reader.fields.items() if field.types}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    # Name-driven loading: an unknown tensor means a model variant we do not understand; never drop it silently.
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows (convert_hf_to_gguf.py: reshape(n_head, 2, d/2, ...).swapaxes(1, 2)).

    Per head llama.cpp interleaves the two RoPE halves row by row; HF keeps them as two contiguous halves.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_hf_tensors(reader: GGUFReader, shape: LlamaShape) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF/numpy layout) for every tensor of the file."""
    for tensor in reader.tensors:
        # dequantize returns numpy order already (GGUF lists dims fastest-first: [in, out] -> (out, in)).
        array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(tensor.shape))
        if array.shape != expected:
            raise ValueError(f"{tensor.name}: dequantized shape {array.shape} != GGUF shape {expected}")
        if ".attn_q." in tensor.name:
            array = unpermute_qk(array, shape.num_heads)
        elif ".attn_k." in tensor.name:
            array = unpermute_qk(array, shape.num_kv_heads)
        yield hf_tensor_name(tensor.name), np.ascontiguousarray(array)


def _f32(value: float) -> float:
    """GGUF stores floats as float32; round-trip through the shortest float32 repr (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def model_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """`config.json` for LlamaForCausalLM from the `llama.*` metadata."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    hidden = int(meta["llama.embedding_length"])
    num_heads = int(meta["llama.attention.head_count"])
    vocab_size = int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // num_heads)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        # llama.cpp writes no `output.weight` when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF rope scaling is not supported by this importer")
    return config


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def tokenizer_spec(meta: dict[str, Any]) -> GgufTokenizerSpec:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE GGUF tokenizers ('gpt2') are supported, not {model!r}")
    return GgufTokenizerSpec(
        tokens=list(meta["tokenizer.ggml.tokens"]),
        merges=list(meta["tokenizer.ggml.merges"]),
        token_types=[int(t) for t in meta["tokenizer.ggml.token_type"]],
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write config/generation config/weights/tokenizer files for `gguf_path` into the existing `out_dir`."""
    logger.info("reading GGUF %s", gguf_path)
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    config = model_config(meta, tensor_names)
    shape = LlamaShape(num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"])

    logger.info("dequantizing %d tensors to float32", len(reader.tensors))
    tensors = dict(iter_hf_tensors(reader, shape))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    logger.info("writing tokenizer and configs")
    spec = tokenizer_spec(meta)
    build_tokenizer(spec).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(spec, config["max_position_embeddings"]))
    if spec.chat_template is not None:
        (out_dir / "chat_template.jinja").write_text(spec.chat_template, encoding="utf-8")
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(meta))
