"""The two-worker test run (tests/conftest.py) runs the folders of PARALLEL_DIRS beside one serial unit of every other
test: their modules must bind no ports and start no servers, and the unit of each test must follow its folder."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import PARALLEL_DIRS, SERIAL, work_unit

TESTS = Path(__file__).resolve().parents[1]
# What a module that serves or listens uses: a socket, a free port, a started cluster, ZMQ.
LISTENS = re.compile(r"^\s*(import|from) (socket|zmq|uvicorn)\b|\bfree_port\(|\bServedCluster\(|\bsmol_cluster\b", re.M)


def test_parallel_folders_bind_no_ports_and_start_no_servers() -> None:
    offenders = [str(path.relative_to(TESTS)) for folder in sorted(PARALLEL_DIRS)
                 for path in sorted((TESTS / folder).rglob("*.py"))
                 if path != Path(__file__).resolve() and LISTENS.search(path.read_text())]
    assert offenders == []


def test_each_parallel_test_is_its_own_unit_and_every_other_test_is_serial() -> None:
    kernel_test = "tests/backend_cuda/test_attention.py::test_prefill_tile_shapes[cfg0]"
    assert work_unit(kernel_test) == kernel_test
    assert work_unit("tests/e2e/test_serving.py::test_greedy_tokens_equal_hf_transformers") == SERIAL
    assert work_unit("tests/worker/test_long_context.py::test_x") == SERIAL
    assert work_unit("tests/backend_cuda_like/test_x.py::test_y") == SERIAL  # a folder's name, not a prefix of it
    assert {"backend_cuda", "backend_cpu"} <= PARALLEL_DIRS
