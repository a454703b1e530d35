"""Checkpoint reading (single file, sharded index), name-driven loading, config parsing and model loading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from infer_backend_cpu import CpuBackend
from infer_core.dtypes import DType
from infer_worker.components.rotary import RopeScaling
from infer_worker.infrastructure.model_loader import load_model
from infer_worker.infrastructure.weight_loader import WeightsNotFoundError, iter_safetensors
from infer_worker.models.llama import LlamaForCausalLM
from infer_worker.models.qwen3 import Qwen3ForCausalLM
from infer_worker.models.registry import model_class
from infer_worker.models.spec import ModelSpec
from tests.worker.tiny_checkpoints import Engine, hf_greedy, llama_config, qwen3_config, write_checkpoint

BACKEND = CpuBackend(device="cpu")


def _state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in model.state_dict().items()}


# ---------------------------------------------------------------- reading safetensors


def test_single_file_and_sharded_checkpoints_yield_the_same_tensors(tmp_path: Path) -> None:
    hf = write_checkpoint(llama_config(), tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    single = dict(iter_safetensors(tmp_path / "single"))
    sharded = dict(iter_safetensors(tmp_path / "sharded"))
    expected = _state_dict(hf)
    assert single.keys() == sharded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(single[name], tensor) and torch.equal(sharded[name], tensor)


def test_sharded_checkpoint_gives_hf_tokens(tmp_path: Path) -> None:
    hf = write_checkpoint(qwen3_config(tied=False), tmp_path, seed=3, max_shard_size="40KB")
    engine = Engine.open(tmp_path)
    prompt = [5, 17, 201, 33, 90, 2]
    seq = engine.new_seq(0, prompt)
    engine.step([(seq, len(prompt))])
    engine.decode([seq], 7)
    assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, 8)


def test_no_weights_names_the_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsNotFoundError, match=str(tmp_path)):
        list(iter_safetensors(tmp_path))


def test_index_with_a_missing_shard_is_refused(tmp_path: Path) -> None:
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    with pytest.raises(WeightsNotFoundError, match="model-00002-of-00002"):
        list(iter_safetensors(tmp_path))


# ---------------------------------------------------------------- name-driven loading


def _spec(**config: Any) -> ModelSpec:
    cfg = llama_config(**config).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    return ModelSpec.from_hf_config(cfg)


def _fresh_llama(spec: ModelSpec) -> LlamaForCausalLM:
    return LlamaForCausalLM(spec, BACKEND.ops, torch.float32, "cpu")


def test_loader_refuses_unexpected_missing_and_misshapen_weights(tmp_path: Path) -> None:
    hf = write_checkpoint(llama_config(), tmp_path)
    weights = _state_dict(hf)
    spec = _spec()
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.extra.weight'"):
        _fresh_llama(spec).load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(2))])
    partial = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match="lacks weights.*model.layers.1.self_attn.v_proj.weight"):
        _fresh_llama(spec).load_weights(partial.items())
    bad = {**weights, "model.norm.weight": torch.ones(65)}
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(65,\)"):
        _fresh_llama(spec).load_weights(bad.items())


def test_fused_projections_hold_each_checkpoint_tensor(tmp_path: Path) -> None:
    hf = write_checkpoint(llama_config(), tmp_path)
    model = _fresh_llama(_spec())
    model.load_weights(iter_safetensors(tmp_path))
    weights = _state_dict(hf)
    attention = model.layers[1].mixer
    expected_qkv = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attention.qkv_proj.weight, expected_qkv)
    mlp = model.layers[0].mlp
    expected_gate_up = torch.cat([weights[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, expected_gate_up)


def test_tied_head_is_the_embedding_and_a_stray_head_copy_is_accepted(tmp_path: Path) -> None:
    hf = write_checkpoint(qwen3_config(tied=True), tmp_path)
    weights = _state_dict(hf)
    config = json.loads((tmp_path / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config)
    assert spec.tie_word_embeddings and spec.qk_norm
    model = Qwen3ForCausalLM(spec, BACKEND.ops, torch.float32, "cpu")
    model.load_weights([*weights.items(), ("lm_head.weight", weights["model.embed_tokens.weight"])])
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].mixer.q_norm_weight is not None


def test_untied_checkpoint_needs_its_head(tmp_path: Path) -> None:
    hf = write_checkpoint(qwen3_config(tied=False), tmp_path)
    weights = {k: v for k, v in _state_dict(hf).items() if k != "lm_head.weight"}
    spec = ModelSpec.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(ValueError, match="lm_head.weight"):
        Qwen3ForCausalLM(spec, BACKEND.ops, torch.float32, "cpu").load_weights(weights.items())


# ---------------------------------------------------------------- config parsing


def test_spec_from_a_transformers_4_style_llama3_config() -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }
    spec = ModelSpec.from_hf_config(config)
    assert spec.head_dim == 64 and spec.num_kv_heads == 8 and spec.rope_theta == 500000.0
    assert spec.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert spec.eos_token_ids == (128001, 128008, 128009) and spec.eos_token_id == 128001
    assert spec.torch_dtype is DType.BFLOAT16 and spec.tie_word_embeddings and not spec.qk_norm


def test_spec_from_a_transformers_5_style_qwen3_config(tmp_path: Path) -> None:
    write_checkpoint(qwen3_config(tied=False, rope_theta=1_000_000.0), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in config
    spec = ModelSpec.from_hf_config(config)
    assert spec.architecture == "Qwen3ForCausalLM" and spec.qk_norm and spec.head_dim == 32
    assert spec.rope_theta == 1_000_000.0 and spec.rope_scaling is None
    assert spec.num_layers == 3 and spec.vocab_size == 256 and spec.eos_token_ids == ()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"architectures": [], "model_type": "gpt2"}, "names no architecture"),
    ],
)
def test_spec_refuses_what_the_model_code_cannot_do(change: dict[str, Any], message: str) -> None:
    config = {**llama_config().to_dict(), "architectures": ["LlamaForCausalLM"], **change}
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(config)


def test_registry_lists_the_supported_architectures() -> None:
    assert model_class("LlamaForCausalLM") is LlamaForCausalLM and model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    with pytest.raises(ValueError, match="MistralForCausalLM.*LlamaForCausalLM, Qwen3ForCausalLM"):
        model_class("MistralForCausalLM")


# ---------------------------------------------------------------- load_model


def test_load_model_in_bf16_stays_close_to_fp32(tmp_path: Path) -> None:
    write_checkpoint(llama_config(), tmp_path, seed=4)
    fp32 = Engine.open(tmp_path)
    bf16 = Engine.open(tmp_path, dtype=DType.BFLOAT16)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16  # type: ignore[attr-defined]
    prompt = [3, 9, 27, 81, 243, 220, 148]
    logits = [engine.prefill_logits(prompt) for engine in (fp32, bf16)]
    assert logits[1].dtype == torch.float32
    error = (logits[0] - logits[1]).abs().max() / logits[0].abs().max()
    assert float(error) < 0.05


def test_dummy_weights_are_deterministic_and_sane(tmp_path: Path) -> None:
    write_checkpoint(qwen3_config(tied=True), tmp_path)
    (tmp_path / "model.safetensors").unlink()  # dummy loading never reads weights
    first, spec = load_model(tmp_path, BACKEND, "auto", "dummy", seed=5)
    again, _ = load_model(tmp_path, BACKEND, "auto", "dummy", seed=5)
    other, _ = load_model(tmp_path, BACKEND, DType.FLOAT32, "dummy", seed=6)
    slots = first.weight_slots()  # type: ignore[attr-defined]
    assert set(slots) >= {"model.embed_tokens.weight", "model.layers.2.self_attn.k_norm.weight"}
    for name, slot in slots.items():
        assert torch.equal(slot.tensor, again.weight_slots()[name].tensor)  # type: ignore[attr-defined]
    assert not torch.equal(first.embed_tokens.weight, other.embed_tokens.weight)  # type: ignore[attr-defined]
    assert torch.equal(first.norm.weight, torch.ones(spec.hidden_size))  # type: ignore[attr-defined]
    assert 0.015 < float(first.embed_tokens.weight.std()) < 0.025  # type: ignore[attr-defined]
    with pytest.raises(WeightsNotFoundError):
        load_model(tmp_path, BACKEND, "auto", "auto", seed=0)
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, BACKEND, "auto", "gguf", seed=0)

