"""Fixtures of the console's tests: a stand-in upstream server (real uvicorn in a thread) and the real
`rustinfer-frontend` CLI in a subprocess proxying to it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.frontend.standin import ServerThread, StandInState, create_standin

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "frontend"


class StandIn:
    def __init__(self, server: ServerThread, state: StandInState) -> None:
        self.server, self.state, self.url = server, state, server.url


@pytest.fixture(scope="module")
def standin() -> Iterator[StandIn]:
    state = StandInState()
    with ServerThread(create_standin(state)) as server:
        yield StandIn(server, state)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FrontendProcess:
    """The real console script, `rustinfer-frontend --server URL --port N`, in a subprocess."""

    def __init__(self, server_url: str, log_path: Path) -> None:
        exe = shutil.which("rustinfer-frontend", path=str(Path(sys.executable).parent))
        assert exe, "the rustinfer-frontend console script is not installed (uv sync)"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([exe, "--server", server_url, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 20.0) -> "FrontendProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rustinfer-frontend exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"rustinfer-frontend did not come up:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def frontend(standin: StandIn, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontendProcess]:
    proc = FrontendProcess(standin.url, tmp_path_factory.mktemp("frontend") / "frontend.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()
