"""Start the three real processes (through `rustinfer serve`, or directly with `DirectCluster`) on a config of
the test's own, over real ZMQ IPC sockets in a private directory, and stop them afterwards."""

from __future__ import annotations

import os
import shutil
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

HEARTBEAT_SECS = 0.2  # the clusters' heartbeat: the server pings the scheduler (and gets a Pong) this often


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
            "heartbeat_interval_secs": HEARTBEAT_SECS,
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
                # Ready once the launcher says so too: until it has seen /ready itself it is still starting up,
                # and a worker that dies then is not restarted (a test that kills it must not race that).
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200 and "rustinfer: ready" in self.log():
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
        return {role: pid for role, pid in self.children()}

    def pids_of(self, role: str) -> list[int]:
        """Every child of that role (there may be several server processes)."""
        return [pid for r, pid in self.children() if r == role]

    def children(self) -> list[tuple[str, int]]:
        assert self.proc is not None
        found: list[tuple[str, int]] = []
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
                    found.append((role, int(entry.name)))
        return found

    def freeze(self, role: str = "worker") -> "Frozen":
        """Stops a process (SIGSTOP) until the returned handle resumes it: with the worker stopped no step runs, so
        a test holds requests in flight by its own hand, not by a token count that the machine's speed decides.
        A stopped worker keeps its sockets open (it is not lost) but sends no heartbeats: keep it stopped for less
        than worker_timeout_secs."""
        return Frozen(self.pids()[role])

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


class Frozen:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        os.kill(pid, signal.SIGSTOP)
        self.resumed = False

    def resume(self) -> None:
        """SIGCONT (idempotent; a process that died meanwhile is fine)."""
        if not self.resumed:
            self.resumed = True
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


ROLES = ("scheduler", "worker", "server")


class DirectCluster(ServedCluster):
    """The three processes started directly (`rustinfer-scheduler/-worker/-server --config FILE`), without the
    launcher: a test can kill or signal one of them and watch the others, which the launcher would tear down.
    Each runs in its own session; `restart(role)` starts a fresh process of a role after it exited."""

    def __init__(self, workdir: Path, **fields: Any) -> None:
        super().__init__(workdir, **fields)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, role: str) -> None:
        exe = Path(sys.executable).parent / f"rustinfer-{role}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUSTINFER_")}
        log = open(self.workdir / f"{role}.log", "ab")
        self.procs[role] = subprocess.Popen([str(exe), "--config", str(self.config_path)], stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def start(self, timeout: float = 600.0) -> "DirectCluster":
        for role in ROLES:
            self._spawn(role)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} exited with {proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"cluster not ready after {timeout} s:\n{self.log()}")

    def restart(self, role: str, timeout: float = 120.0) -> None:
        proc = self.procs[role]
        assert proc.poll() is not None, f"{role} is still running"
        self._spawn(role)
        self.wait_ready(timeout)

    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.procs.items() if p.poll() is None}

    def log(self) -> str:
        parts = []
        for role in ROLES:
            path = self.workdir / f"{role}.log"
            if path.exists():
                parts.append(f"--- {role}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self) -> int | None:
        """SIGTERM to every process still running (server first), SIGKILL to any left after 30 s."""
        for role in ("server", "scheduler", "worker"):
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        return None
