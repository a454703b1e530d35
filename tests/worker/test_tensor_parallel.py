"""Tensor parallelism below the processes of a cluster: ranks as spawned processes over a real gloo group (the CPU
backend's `GlooCollective`), each loading only its shard, give the tokens of one rank and its logprobs to float
noise (dense Llama from a sharded safetensors index; block FP8 split on its 128-blocks); the loader reads slices;
start-up refuses what cannot be split, in one line naming the field."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file

from infer_backend_cpu import CpuBackend
from infer_core.ports.backend import LlmBackend
from infer_protocol.config import Config, ConfigError
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.components.sharding import Parallel, Shard
from infer_worker.domain.sequence import GREEDY, Sampling, ScheduledSeq, Sequence
from infer_worker.infrastructure.bootstrap import StartupError, bootstrap
from infer_worker.infrastructure.model_loader import load_model, read_spec
from infer_worker.infrastructure.rank_group import rank_device
from infer_worker.infrastructure.weight_loader import iter_safetensors
from infer_worker.models.tensor_parallel import check_tensor_parallel
from tests.e2e.tp_models import Shape, write_checkpoint
from tests.worker.quant_checkpoints import fp8_config, write_quantized

DENSE = Shape("LlamaForCausalLM", heads=8, kv_heads=4, head_dim=8, intermediate=96, vocab=256)
# Every split dimension a whole number of 128-blocks per rank at TP = 2: q and kv 256 wide, intermediate 256.
FP8 = Shape("Qwen3ForCausalLM", heads=4, kv_heads=4, head_dim=64, intermediate=256, vocab=256, hidden=128)
BLOCK = 4
STEPS = 6


def generate(model_dir: Path, backend: LlmBackend, graphs: bool = False) -> dict[str, Any]:
    """A greedy and a seeded sampled sequence batched together: prefill, then decodes (replaying CUDA graphs, with
    their collectives, when `graphs`)."""
    model, spec = load_model(model_dir, backend)
    world = backend.ops.collective.world_size
    caches = backend.allocate_kv_cache(spec.num_layers, 32, BLOCK, spec.num_kv_heads // world, spec.head_dim,
                                       backend.default_dtype())
    if graphs:
        runner: ModelRunner = GraphModelRunner(model, backend, caches, BLOCK, 16, backend.device, capture_sizes=[1, 2])
        runner.capture()
    else:
        runner = ModelRunner(model, backend, caches, BLOCK, 16, backend.device)
    seqs = [Sequence(0, [3, 17, 250, 9, 41, 77, 5], 0, list(range(0, 16)), GREEDY),
            Sequence(1, [200, 1, 64, 128], 0, list(range(16, 32)), Sampling(temperature=0.9, seed=5))]
    logprobs: list[float] = []
    for _ in range(STEPS):
        out = runner.execute([ScheduledSeq(s, s.num_tokens - s.num_computed) for s in seqs])
        for seq, token in zip(seqs, out.token_ids):
            seq.num_computed = seq.num_tokens
            seq.token_ids.append(token)
        logprobs += out.logprobs
    return {"tokens": [s.token_ids for s in seqs], "logprobs": logprobs, "kv_heads": caches[0][0].shape[2]}


Job = Callable[[int, LlmBackend], Any]  # (rank, backend in the group) -> what the rank reports


def _rank(rank: int, world: int, store: str, make_backend: Callable[[int], LlmBackend], job: Job,
          out: Path) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                         timeout=timedelta(seconds=60))
    backend = make_backend(rank)
    backend.join_tensor_parallel(60.0)
    torch.save(job(rank, backend), out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def run_ranks(world: int, make_backend: Callable[[int], LlmBackend], job: Job, tmp: Path) -> list[Any]:
    """`job` on each of `world` spawned ranks of one group; what each returned, in rank order."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp / "store"), make_backend, job, tmp))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


def _cpu(_rank: int) -> LlmBackend:
    return CpuBackend()


def assert_like_one_rank(alone: dict[str, Any], ranks: list[dict[str, Any]], atol: float = 1e-4) -> None:
    world = len(ranks)
    for result in ranks:
        assert result["tokens"] == alone["tokens"]
        torch.testing.assert_close(result["logprobs"], alone["logprobs"], atol=atol, rtol=atol)
        assert result["kv_heads"] == alone["kv_heads"] // world  # each rank caches its own KV heads
    assert len(set(alone["tokens"][0][7:])) > 1  # the model says something, not one token over and over


def generate_job(model_dir: Path, graphs: bool = False) -> Job:
    return functools.partial(_generate_job, model_dir, graphs)


def _generate_job(model_dir: Path, graphs: bool, _rank: int, backend: LlmBackend) -> dict[str, Any]:
    return generate(model_dir, backend, graphs)


def test_ranks_match_one_rank_dense_from_a_sharded_index_with_biases_and_block_fp8(tmp_path: Path) -> None:
    """One group of two ranks runs the three models (one process start per rank for all): dense Llama from a
    sharded index, the same with a bias on every projection (split with a column-parallel output, added once after
    a row-parallel reduce), and block FP8 Qwen3."""
    dense = write_checkpoint(tmp_path / "dense", None, DENSE, seed=3, files=3)
    biased = write_checkpoint(tmp_path / "biased", None, DENSE._replace(bias=True), seed=6)
    fp8_dense = write_checkpoint(tmp_path / "fp8-dense", None, FP8, seed=4)
    fp8 = tmp_path / "fp8"
    write_quantized(load_file(str(fp8_dense / "model.safetensors")),
                    json.loads((fp8_dense / "config.json").read_text()), fp8, fp8_config((128, 128)), torch.float32)
    models = (dense, biased, fp8)
    ranks = run_ranks(2, _cpu, functools.partial(_generate_each, models), tmp_path)
    for i, model_dir in enumerate(models):
        assert_like_one_rank(generate(model_dir, CpuBackend()), [result[i] for result in ranks])


def _generate_each(model_dirs: tuple[Path, ...], _rank: int, backend: LlmBackend) -> list[dict[str, Any]]:
    return [generate(model_dir, backend) for model_dir in model_dirs]


def test_the_loader_reads_only_each_ranks_slice_from_an_index(tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path / "m", None, DENSE, seed=5, files=2)
    whole = dict(iter_safetensors(model_dir))
    q, o = "model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    for rank in range(2):
        slices = {q: Shard(Parallel.COLUMN.shard_dim or 0, rank, 2), o: Shard(Parallel.ROW.shard_dim or 1, rank, 2)}
        read = dict(iter_safetensors(model_dir, slices))
        assert read.keys() == whole.keys()
        torch.testing.assert_close(read[q], whole[q][rank * 32:(rank + 1) * 32], atol=0, rtol=0)
        torch.testing.assert_close(read[o], whole[o][:, rank * 32:(rank + 1) * 32], atol=0, rtol=0)
        name = "model.norm.weight"
        torch.testing.assert_close(read[name], whole[name], atol=0, rtol=0)


@pytest.mark.parametrize(("shape", "world", "message"), [
    (DENSE._replace(heads=6, kv_heads=6), 4, "config.json num_attention_heads = 6 does not divide by "
                                             "tensor_parallel_size 4"),
    (DENSE, 8, "config.json num_key_value_heads = 4 does not divide by tensor_parallel_size 8"),
    (DENSE._replace(intermediate=98), 4, "config.json intermediate_size = 98 does not divide by "
                                         "tensor_parallel_size 4"),
    (DENSE._replace(vocab=250), 4, "config.json vocab_size = 250 does not divide by tensor_parallel_size 4"),
])
def test_start_up_refuses_a_split_that_does_not_divide(tmp_path: Path, shape: Shape, world: int,
                                                       message: str) -> None:
    model_dir = write_checkpoint(tmp_path / "m", None, shape, seed=1)
    with pytest.raises(StartupError) as err:
        bootstrap(Config(model=str(model_dir), backend="cpu", tensor_parallel_size=world), lambda _s: None)
    assert str(err.value) == message


def test_start_up_refuses_awq_and_fp8_blocks_a_rank_would_cut(tmp_path: Path) -> None:
    awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    spec = read_spec(write_checkpoint(tmp_path / "awq", None, DENSE, seed=1,
                                      config_overrides={"quantization_config": awq}))
    with pytest.raises(ValueError, match=r"^quantization_config.quant_method 'awq' is not supported with "
                                         r"tensor_parallel_size 2 "):
        check_tensor_parallel(spec, 2)
    check_tensor_parallel(spec, 1)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    spec = read_spec(write_checkpoint(tmp_path / "fp8", None, FP8, seed=1,
                                      config_overrides={"quantization_config": fp8}))
    check_tensor_parallel(spec, 2)
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(spec, 4)
    assert str(err.value) == ("config.json num_attention_heads * head_dim = 256 over tensor_parallel_size 4 gives 64, "
                              "not a multiple of the FP8 block 128 (quantization_config.weight_block_size)")


def test_tp_config_fields_and_devices() -> None:
    assert Config(tensor_parallel_size=4).tensor_parallel_size == 4
    for field in ("tp_operation_timeout_secs", "tp_startup_timeout_secs"):
        with pytest.raises(ConfigError, match=f"'{field}' must be > 0"):
            Config(**{field: 0.0})
    assert [rank_device("cuda:2", "cuda", r) for r in range(3)] == ["cuda:2", "cuda:3", "cuda:4"]
    assert rank_device("", "cuda", 1) == "cuda:1"
    assert rank_device("cpu", "cpu", 3) == "cpu"


def test_the_worker_refuses_an_unsplittable_model_and_leaves_no_rank_behind(tmp_path: Path) -> None:
    """The real `rustinfer-worker` at TP = 4: it forks its ranks, refuses the model in one line (naming the field)
    and exits 1, its ranks killed with it (none is left in its process group)."""
    model_dir = write_checkpoint(tmp_path / "m", None, DENSE._replace(heads=6, kv_heads=6), seed=1)
    config = tmp_path / "worker.toml"
    config.write_text(f'model = "{model_dir}"\nbackend = "cpu"\ntensor_parallel_size = 4\n'
                      f'ipc_dir = "{tmp_path}"\ncluster_id = "tp-refusal"\nlog_level = "warning"\n')
    proc = subprocess.Popen([sys.executable, "-c", "from infer_worker.cli import main; main()", "--config",
                             str(config)], stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert "start-up failed: config.json num_attention_heads = 6 does not divide by tensor_parallel_size 4" in stderr
    with pytest.raises(ProcessLookupError):  # the session's group: the worker and every rank it forked
        os.killpg(proc.pid, 0)


def test_start_up_refuses_a_hybrid_model(tmp_path: Path) -> None:
    """Gated DeltaNet layers are not sharded: a Qwen3.5 checkpoint under TP is refused in one line, not run
    with those layers silently replicated."""
    from tests.worker.qwen3_5_checkpoints import write_qwen3_5

    write_qwen3_5(tmp_path / "q35")
    spec = read_spec(tmp_path / "q35")
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(spec, 2)
    assert str(err.value) == ("config.json layer_types has linear_attention layers (a hybrid model): not supported "
                              "with tensor_parallel_size 2; use tensor_parallel_size 1")
    check_tensor_parallel(spec, 1)
