"""On two GPUs: the NCCL adapter's collectives, eager and captured in CUDA graphs (replayed on new inputs), and
the sharded model on ranks of cuda:0 and cuda:1 giving the tokens of one rank, eager and replaying decode graphs
whose collectives are captured with them (fp32, so that the ranks' summation order cannot flip a token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from infer_backend_cpu import CpuBackend
from infer_core.ports.backend import LlmBackend
from tests.e2e.tp_models import Shape, write_checkpoint
from tests.worker.test_tensor_parallel import assert_like_one_rank, generate, generate_job, run_ranks

pytestmark = pytest.mark.gpu
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

MODEL = Shape("LlamaForCausalLM", heads=8, kv_heads=4, head_dim=16, intermediate=128, vocab=256)


def _cuda(rank: int) -> LlmBackend:
    from infer_backend_cuda import CudaBackend

    return CudaBackend(f"cuda:{rank}", dtype="float32")


def _collectives(rank: int, backend: LlmBackend) -> dict[str, Any]:
    coll = backend.ops.collective
    device = backend.device
    x = torch.full((4, 8), float(rank + 1), device=device)
    summed = torch.empty_like(x)
    gathered = torch.empty((4, 8 * coll.world_size), device=device)

    def step() -> None:
        summed.copy_(coll.all_reduce(x.clone()))
        gathered.copy_(coll.all_gather(x, dim=-1))

    step()
    eager = (summed.clone().cpu(), gathered.clone().cpu())
    graph = backend.capture_graph(step)
    x.fill_(10.0 * (rank + 1))
    graph.replay()
    backend.synchronize()
    return {"eager": eager, "replayed": (summed.cpu(), gathered.cpu()), "world": coll.world_size}


@pytest.mark.parametrize("world", [pytest.param(1), pytest.param(2, marks=TWO_GPUS)])
def test_nccl_collectives_eager_and_in_cuda_graphs(tmp_path: Path, world: int) -> None:
    def ranks_of(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [torch.full((4, 8), scale * (r + 1)) for r in range(world)]
        return sum(parts[1:], parts[0]), torch.cat(parts, dim=-1)

    for rank, result in enumerate(run_ranks(world, _cuda, _collectives, tmp_path)):
        assert result["world"] == world
        for got, want in zip(result["eager"], ranks_of(1.0)):
            assert torch.equal(got, want), rank
        for got, want in zip(result["replayed"], ranks_of(10.0)):  # the captured collectives read the new inputs
            assert torch.equal(got, want), rank


@TWO_GPUS
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_two_gpu_ranks_give_the_tokens_of_one(tmp_path: Path, graphs: bool) -> None:
    model_dir = write_checkpoint(tmp_path / "m", None, MODEL, seed=3, files=2)
    assert_like_one_rank(generate(model_dir, CpuBackend()), run_ranks(2, _cuda, generate_job(model_dir, graphs),
                                                                      tmp_path), atol=1e-3)
