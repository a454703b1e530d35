"""Suite-wide set-up. Without a GPU the CUDA adapter's kernels run in simulation: Triton's interpreter and
Numba's CUDA simulator must be switched on before either library is first imported, so it happens here."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import ServedCluster


def _has_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    import torch

    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    from infer_worker.infrastructure.embedded_model import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="session")
def smol_cluster(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Iterator[ServedCluster]:
    """The default deployment: the embedded SmolLM2 on the CPU backend, shared by the e2e and browser tests."""
    cluster = ServedCluster(tmp_path_factory.mktemp("smol"), max_model_len=2048, max_batch_seqs=16)
    cluster.start()
    yield cluster
    cluster.stop()
