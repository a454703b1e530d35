"""On the GPU: grammar rows beside free ones through the scheduler's engine and the worker service on the CUDA
backend (fp32), eager and with real CUDA-graph replay (constrained steps replay mixed graphs, which stop at the
logits): outputs follow the schema, the pipelines agree, preemption replays a matcher; and the masked sampling
graph gives every row, free or constrained, the tokens the eager sampling after the graph gives it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.test_structured_output import check_structured_through_the_engine
from tests.worker.tiny_checkpoints import llama_config, write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_structured_rows_on_cuda(tmp_path: Path, graphs: bool) -> None:
    from infer_backend_cuda import CudaBackend

    write_checkpoint(llama_config(), tmp_path, seed=5)
    # (free rows are compared with the CPU test's run: on the GPU another batch may pick other GEMM kernels)
    check_structured_through_the_engine(tmp_path, graphs, lambda: CudaBackend("cuda:0"), compare_free=False)


def test_the_masked_sampling_graph_samples_every_row_as_the_eager_sampling_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Free rows too: inside the captured graph they once read all-zero bitmask words (every token refused). The
    same batches, the same decode graphs up to the logits; only the sampling of grammar steps differs (one replay
    of mask + sampler, or the eager ops after the graph: INFER_MASKED_SAMPLING=0)."""
    from infer_backend_cuda import CudaBackend

    write_checkpoint(llama_config(), tmp_path, seed=5)
    graphed = check_structured_through_the_engine(tmp_path, True, lambda: CudaBackend("cuda:0"), compare_free=False)
    monkeypatch.setenv("INFER_MASKED_SAMPLING", "0")
    eager = check_structured_through_the_engine(tmp_path, True, lambda: CudaBackend("cuda:0"), compare_free=False,
                                                masked_graphs=False)
    assert graphed == eager
