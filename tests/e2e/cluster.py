"""Start the three real processes (through `rustinfer serve`) on a config of the test's own, over real ZMQ
IPC sockets in a private directory, and stop them afterwards."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


class ServedCluster:
    def __init__(self, workdir: Path, **fields: Any) -> None:
        self.workdir = workdir
        self.port = free_port()
        ipc_dir = Path("/tmp") / f"ri-{uuid.uuid4().hex[:8]}"  # short: AF_UNIX paths are limited to ~107 bytes
        ipc_dir.mkdir()
        self.ipc_dir = ipc_dir
        config = {
            "backend": "cpu",
            "port": self.port,
            "cluster_id": f"t{uuid.uuid4().hex[:8]}",
            "ipc_dir": str(ipc_dir),
            "heartbeat_interval_secs": 0.2,
            "worker_timeout_secs": 5.0,
            "log_level": "warning",
        } | fields
        self.config_path = workdir / "rustinfer.toml"
        self.config_path.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in config.items()))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "cluster.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600.0) -> "ServedCluster":
        log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUSTINFER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from rustinfer.launcher import main; main()", "serve", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cluster exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"cluster not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def pids(self) -> dict[str, int]:
        """The launcher's children by role, read from /proc (the command line names the role)."""
        assert self.proc is not None
        found: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != self.proc.pid:
                continue
            for role in ("scheduler", "worker", "server"):
                if f"rustinfer-{role}" in cmdline or f"infer_{role}.cli" in cmdline:
                    found[role] = int(entry.name)
        return found

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
