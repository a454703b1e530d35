"""Start-up of the worker: the application's assembly (KV sizing by budget or memory profile, the self-check) and
the infrastructure's bootstrap around it (model directory, backend, weights)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from infer_backend_cpu import CpuBackend
from infer_core.dtypes import DType
from infer_protocol.config import Config
from infer_worker.application.kv_sizing import KvGeometry
from infer_worker.application.assembly import StartupError, assemble, profile_num_blocks
from infer_worker.infrastructure.backend_registry import create_backend
from infer_worker.infrastructure.bootstrap import bootstrap, resolve_model_dir
from infer_worker.infrastructure.model_loader import load_model
from tests.worker.tiny_checkpoints import llama_config, write_checkpoint


class ProfiledCpuBackend(CpuBackend):
    """Reports a fixed device size and a fixed peak, as a GPU backend would after the worst-case forward."""

    host_memory = False  # so the assembly profiles it, as it would a GPU

    def memory_info(self):  # noqa: ANN201
        from infer_core.ports.backend import MemoryInfo

        return MemoryInfo(free_bytes=600 << 20, total_bytes=1000 << 20)

    def peak_memory_bytes(self) -> int:
        return 300 << 20


def test_profiled_kv_budget_is_fraction_minus_peak(tmp_path: Path) -> None:
    write_checkpoint(llama_config(), tmp_path)
    backend = ProfiledCpuBackend()
    model, spec = load_model(tmp_path, backend, DType.FLOAT32, "auto", 0)
    config = Config(max_batch_tokens=64, max_batch_seqs=4, mem_fraction_static=0.5, block_size=4)
    geometry = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, 4, 4)
    blocks = profile_num_blocks(config, backend, model, DType.FLOAT32, geometry, 128, useful=10**9)
    assert blocks == ((500 << 20) - (300 << 20)) // geometry.bytes_per_block
    capped = profile_num_blocks(config, backend, model, DType.FLOAT32, geometry, 128, useful=7)
    assert capped == 7


def test_a_device_backend_is_profiled_and_a_host_one_gets_the_byte_budget(tmp_path: Path) -> None:
    """The assembly asks the port (`host_memory`), never the device string, which of the two sizings applies."""
    write_checkpoint(llama_config(), tmp_path)
    config = Config(max_batch_tokens=64, max_batch_seqs=4, mem_fraction_static=0.5, block_size=4, max_model_len=128)
    geometry = KvGeometry(2, 2, 16, 4, 4)
    lines: list[str] = []
    profiled = ProfiledCpuBackend()
    model, _ = load_model(tmp_path, profiled, DType.FLOAT32, "auto", 0)
    ready = assemble(config, profiled, model, tmp_path, 128, lines.append)
    assert ready.num_blocks == 4 * 32  # useful: max_batch_seqs x the blocks of one 128-token sequence
    assert "profiling memory with a worst-case forward" in lines
    lines.clear()
    host = CpuBackend()
    model, _ = load_model(tmp_path, host, DType.FLOAT32, "auto", 0)
    budget = Config(block_size=4, max_model_len=128, cpu_kv_cache_bytes=50 * geometry.bytes_per_block)
    assert assemble(budget, host, model, tmp_path, 128, lines.append).num_blocks == 50
    assert "profiling memory with a worst-case forward" not in lines


def test_the_ready_worker_reports_the_mixed_graph_buckets_it_captured(tmp_path: Path) -> None:
    """The scheduler fits prompt chunks to what the worker captured (`Ready.graph_step_tokens`): the configured
    buckets within the step budget where the backend captures graphs, none where it does not or graphs are off."""
    from tests.worker.test_graph_runner import ReplayingCpuBackend

    write_checkpoint(llama_config(), tmp_path)
    config = Config(max_batch_tokens=96, max_batch_seqs=4, block_size=4, max_model_len=128, num_blocks=40,
                    capture_sizes=[1, 2, 4], capture_tokens=[32, 8, 128, 64])
    for backend, graphs, expected in ((ReplayingCpuBackend(), True, (8, 32, 64)), (ReplayingCpuBackend(), False, ()),
                                      (CpuBackend(), True, ())):
        model, _ = load_model(tmp_path, backend, DType.FLOAT32, "auto", 0)
        cfg = msgspec.structs.replace(config, enable_cuda_graphs=graphs)
        assert assemble(cfg, backend, model, tmp_path, 128, lambda _s: None).graph_step_tokens == expected


def test_create_backend_constructs_the_configured_dtype() -> None:
    assert create_backend("cpu", "cpu").default_dtype() is DType.FLOAT32  # auto: the backend's choice
    assert create_backend("cpu", "cpu", "bf16").default_dtype() is DType.BFLOAT16
    assert create_backend("cpu", "cpu", DType.FLOAT16).default_dtype() is DType.FLOAT16


def test_bootstrap_loads_the_configured_dtype(tmp_path: Path) -> None:
    write_checkpoint(llama_config(), tmp_path)
    ready = bootstrap(Config(model=str(tmp_path), backend="cpu", num_blocks=40, block_size=4, dtype="bfloat16"),
                      lambda _s: None)
    assert ready.model.dtype == "bfloat16"


def test_bootstrap_reports_geometry_and_serves_a_step(tmp_path: Path) -> None:
    write_checkpoint(llama_config(), tmp_path)
    ready = bootstrap(Config(model=str(tmp_path), backend="cpu", num_blocks=40, block_size=4), lambda _s: None)
    assert (ready.num_blocks, ready.block_size) == (40, 4)
    assert ready.model.backend == "cpu" and ready.model.dtype == "float32" and ready.model.vocab_size > 0


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="model directory not found"):
        resolve_model_dir(Config(model=str(tmp_path / "nope")))
    with pytest.raises(StartupError, match="no config.json"):
        resolve_model_dir(Config(model=str(tmp_path)))


# ------------------------------------------------------------------ start-up refusals

# Trimmed from real checkpoints: a Qwen3.5 (multimodal: its text settings sit under text_config) and an AWQ one.
QWEN3_5_CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256},
}
AWQ_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "head_dim": 16,
    "max_position_embeddings": 256,
    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
}
OTHER_CONFIG = {**QWEN3_5_CONFIG, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
GPTQ_CONFIG = {**AWQ_CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}


def _config_only(path: Path, config: dict) -> Path:
    """A model directory with config.json and no weights: a refusal must come before any weight is read."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("config", "message"), [
    (QWEN3_5_CONFIG, "config.json of Qwen3_5ForConditionalGeneration lacks intermediate_size"),
    (OTHER_CONFIG, "model architecture Qwen3NextForCausalLM (model_type qwen3_next) is not supported; "
                   "supported: LlamaForCausalLM, Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration"),
    (GPTQ_CONFIG, "unsupported quantization_config.quant_method 'gptq'; supported: 'awq'"),
    (AWQ_CONFIG, "model.layers.0.self_attn.q_proj: quantization_config.group_size 128 does not divide"),
], ids=["qwen3_5_text_config_read", "unknown_architecture", "gptq", "awq_group_that_does_not_divide"])
def test_unservable_checkpoints_are_refused_from_config_json(tmp_path: Path, config: dict, message: str) -> None:
    model_dir = _config_only(tmp_path / "model", config)
    with pytest.raises((StartupError, ValueError)) as err:  # both end the worker with "start-up failed: <message>"
        bootstrap(Config(model=str(model_dir), backend="cpu"), lambda _s: None)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_config_without_a_needed_key_names_it(tmp_path: Path) -> None:
    from infer_worker.models.spec import ModelSpec

    with pytest.raises(ValueError, match="config.json of LlamaForCausalLM lacks hidden_size"):
        ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
                                  "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 16})


def test_max_model_len_beyond_the_models_positions_is_refused(tmp_path: Path) -> None:
    model_dir = _config_only(tmp_path / "model", {**AWQ_CONFIG, "quantization_config": None,
                                                  "max_position_embeddings": 40960})
    with pytest.raises(StartupError) as err:
        bootstrap(Config(model=str(model_dir), backend="cpu", max_model_len=50000), lambda _s: None)
    assert str(err.value) == ("max_model_len 50000 exceeds the model's max_position_embeddings 40960; "
                              "lower --max-model-len / max_model_len")


def test_a_kv_cache_that_cannot_hold_one_max_model_len_sequence(tmp_path: Path) -> None:
    """40 blocks of 4 tokens hold 160 tokens: an explicit max_model_len of 256 (64 blocks) is refused naming both
    numbers and the fixes; left on auto (the model's 256) it is lowered to 160, which the scheduler then uses."""
    write_checkpoint(llama_config(), tmp_path)
    with pytest.raises(StartupError) as err:
        bootstrap(Config(model=str(tmp_path), backend="cpu", num_blocks=40, block_size=4, max_model_len=256),
                  lambda _s: None)
    message = str(err.value)
    assert "needs 64 KV blocks of 4 tokens but the KV cache has only 40 (160 tokens)" in message
    assert "lower max_model_len" in message and "cpu_kv_cache_bytes" in message and "\n" not in message
    lines: list[str] = []
    ready = bootstrap(Config(model=str(tmp_path), backend="cpu", num_blocks=40, block_size=4), lines.append)
    assert ready.model.max_model_len == 160
    assert any("max_model_len 160" in line for line in lines)
    # the CPU budget path: 10 blocks' worth of bytes
    spec_bytes = KvGeometry(2, 2, 16, 4, 4).bytes_per_block
    with pytest.raises(StartupError, match="cpu_kv_cache_bytes"):
        bootstrap(Config(model=str(tmp_path), backend="cpu", block_size=4, max_model_len=256,
                         cpu_kv_cache_bytes=10 * spec_bytes), lambda _s: None)
