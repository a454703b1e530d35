from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import ServedCluster


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    from infer_worker.infrastructure.embedded_model import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="session")
def smol_cluster(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Iterator[ServedCluster]:
    """The default deployment: the embedded SmolLM2 on the CPU backend."""
    cluster = ServedCluster(tmp_path_factory.mktemp("smol"), max_model_len=2048, max_batch_seqs=16)
    cluster.start()
    yield cluster
    cluster.stop()
