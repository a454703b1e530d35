"""Start-up pieces of the worker: KV sizing by memory profile, the self-check, and a full bootstrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer_backend_cpu import CpuBackend
from infer_core.dtypes import DType
from infer_protocol.config import Config
from infer_worker.application.kv_sizing import KvGeometry
from infer_worker.infrastructure.bootstrap import StartupError, bootstrap, profile_num_blocks, resolve_model_dir
from infer_worker.infrastructure.model_loader import load_model
from tests.worker.tiny_checkpoints import llama_config, write_checkpoint


class ProfiledCpuBackend(CpuBackend):
    """Reports a fixed device size and a fixed peak, as a GPU backend would after the worst-case forward."""

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
