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

# Without a GPU the default run (`uv run pytest`, markers "not gpu") spreads over two pytest-xdist workers: the
# interpreted kernels (one busy core each, ~460 s of the run) beside everything that starts processes or binds ports,
# which runs on one worker in collection order as one work unit (SERIAL): two clusters at once would race for ports
# and halve each other's CPU. `-n 0` runs the whole suite in one process; GPU runs (`-m gpu`) and runs without xdist
# are untouched. (xdist's `xdist_group` mark cannot do this under pytest 9.2: it rewrites `item._nodeid`, which node
# ids no longer read.)
XDIST_WORKERS = 2
SERIAL = "serial"
PARALLEL_DIRS = frozenset({"backend_cuda", "backend_cpu", "architecture"})  # no processes of their own, no ports
_SERIAL_UNITS = pytest.StashKey[bool]()  # set where this run schedules SERIAL and PARALLEL_DIRS' tests as above


def work_unit(nodeid: str) -> str:
    """The scheduling unit of a test: each test of PARALLEL_DIRS alone (so the worker that ran SERIAL is never left
    with a whole module after it), every other test in SERIAL."""
    parts = nodeid.split("/")
    return nodeid if len(parts) > 2 and parts[0] == "tests" and parts[1] in PARALLEL_DIRS else SERIAL


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    option = config.option
    if (not hasattr(option, "numprocesses") or option.numprocesses is not None or option.markexpr != "not gpu"
            or option.collectonly or "PYTEST_XDIST_WORKER" in os.environ or _has_cuda()):
        return
    option.numprocesses = XDIST_WORKERS
    # One OpenMP thread in every process of the run (the workers and the clusters they start inherit it): with the
    # other core busy, a second thread's barriers wait for a descheduled thread (tests/torch_threads.py); one e2e
    # test went from 9 s to 119 s so.
    os.environ["OMP_NUM_THREADS"] = "1"
    option.dist = "loadscope"
    option.loadscopereorder = True  # the largest unit (SERIAL) first, so that it starts at once
    config.stash[_SERIAL_UNITS] = True


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed (the GPU image) it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if not config.stash.get(_SERIAL_UNITS, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SerialUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return SerialUnitScheduling(config, log)


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
