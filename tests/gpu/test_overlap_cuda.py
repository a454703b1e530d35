"""On the GPU: the one-step-ahead pipeline gives the synchronous pipeline's tokens on the CUDA backend (fp32),
eager and with real CUDA-graph replay — the decode inputs are gathered on the device from the previous launch's
sampled tokens, and the sampled ids come back through pinned asynchronous copies."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.test_overlap_pipeline import check_overlap_equals_sync
from tests.worker.tiny_checkpoints import qwen3_config, write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_overlapped_pipeline_gives_the_synchronous_tokens_on_cuda(tmp_path: Path, graphs: bool) -> None:
    from infer_backend_cuda import CudaBackend

    write_checkpoint(qwen3_config(tied=True), tmp_path, seed=5)
    check_overlap_equals_sync(tmp_path, graphs, lambda: CudaBackend("cuda:0"))
