"""`rustinfer serve`: start scheduler, worker and server on one config, wait until ready, and keep the three
alive together. A worker that dies once the cluster served is restarted (the scheduler fails its requests with
`worker_lost` and adopts the new one), at most `worker_max_restarts` times within `worker_restart_window_secs`,
after a backoff that doubles; past that, or when the scheduler or a server dies, or on Ctrl-C / SIGTERM, all are
torn down (SIGTERM: after draining)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import httpx

from infer_protocol.config import ENV_PREFIX, Config, ConfigError, dump_config, ipc_listener
from infer_protocol.config_cli import add_config_arguments, load_config_from_args
from infer_worker.infrastructure.model_source import ModelSourceError, resolve_model_source

PROCESSES = ("scheduler", "worker", "server")
WORKSPACE_PACKAGES = ("infer-core", "infer-protocol", "infer-server", "infer-scheduler", "infer-worker",
                      "infer-backend-cpu", "infer-backend-cuda", "infer-frontend")
_STOP_GRACE_SECS = 3.0  # past shutdown_timeout_secs, for the processes to act on their own deadline


def _command(name: str, config_path: str) -> list[str]:
    role = name.split("-")[0]  # "server-2" is the second server process
    script = Path(sys.executable).parent / f"rustinfer-{role}"
    if script.exists():
        return [str(script), "--config", config_path]
    module = {"scheduler": "infer_scheduler.cli", "worker": "infer_worker.cli", "server": "infer_server.cli"}[role]
    return [sys.executable, "-c", f"from {module} import main; main()", "--config", config_path]


def child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The processes' environment, without the `RUSTINFER_<FIELD>` variables: the config file they get already holds
    them, and left in place they would override that file's values from the flags (env > file in each process)."""
    return {k: v for k, v in environ.items() if not k.startswith(ENV_PREFIX)}


class Cluster:
    def __init__(self, config: Config) -> None:
        self.config = config
        handle, self._config_path = tempfile.mkstemp(prefix="rustinfer-", suffix=".toml")
        with os.fdopen(handle, "w") as fh:
            fh.write(dump_config(config))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._metrics_dir: str | None = None

    @property
    def url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.config.port}"

    def start(self) -> None:
        servers = [f"server-{i}" for i in range(2, self.config.server_processes + 1)]
        env = child_environ(os.environ)
        server_env = env
        if servers:  # the server processes share their Prometheus counters through files in one directory
            self._metrics_dir = tempfile.mkdtemp(prefix="rustinfer-metrics-")
            server_env = env | {"PROMETHEUS_MULTIPROC_DIR": self._metrics_dir}
        for name in (*PROCESSES, *servers):
            self.procs[name] = subprocess.Popen(_command(name, self._config_path),
                                                env=server_env if name.startswith("server") else env)

    def restart_worker(self) -> None:
        """A fresh worker on the same config: it connects to the running scheduler, which adopts it at its Ready."""
        self.procs["worker"] = subprocess.Popen(_command("worker", self._config_path), env=child_environ(os.environ))

    def dead(self, skip: tuple[str, ...] = ()) -> tuple[str, int] | None:
        for role, proc in self.procs.items():
            if role in skip:
                continue
            code = proc.poll()
            if code is not None:
                return role, code
        return None

    def stop(self) -> None:
        """Drain, then stop, in the order requests flow. The servers get SIGTERM first and finish the requests
        they accepted (up to shutdown_timeout_secs) while the scheduler still serves them — signalled together,
        the scheduler would refuse a request a server had accepted but not yet forwarded. Then the scheduler
        gets SIGTERM and tells the worker to exit (a worker signalled at once would abandon the drain); the
        worker gets SIGTERM only once the scheduler is gone. Whatever still runs past its deadline is killed."""
        deadline = time.monotonic() + self.config.shutdown_timeout_secs + _STOP_GRACE_SECS
        servers = [name for name in self.procs if name.startswith("server")]
        self._signal(servers)
        for role in servers:
            self._wait(role, deadline)
        self._signal(["scheduler"])
        deadline = max(deadline, time.monotonic() + _STOP_GRACE_SECS)
        self._wait("scheduler", deadline)
        worker = self.procs.get("worker")
        if worker is not None and worker.poll() is None:
            try:  # the scheduler's Shutdown normally stops it
                worker.wait(timeout=min(_STOP_GRACE_SECS, max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                worker.send_signal(signal.SIGTERM)
        self._wait("worker", deadline)
        Path(self._config_path).unlink(missing_ok=True)
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def _signal(self, roles: list[str]) -> None:
        for role in roles:
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def _wait(self, role: str, deadline: float) -> None:
        proc = self.procs.get(role)
        if proc is None:
            return
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready_status(client: httpx.Client, url: str) -> tuple[bool, str]:
    try:
        resp = client.get(f"{url}/ready", timeout=2.0)
    except httpx.HTTPError:
        return False, "waiting for the HTTP server"
    try:
        body = resp.json()
        status = str(body.get("detail") or "") if resp.status_code != 200 else ""
    except ValueError:
        status = ""
    return resp.status_code == 200, status


def _wait_ready(cluster: Cluster, stopping: list[int]) -> int:
    last = ""
    deadline = time.monotonic() + cluster.config.ready_timeout_secs
    with httpx.Client() as client:
        while not stopping:
            dead = cluster.dead()
            if dead:
                print(f"rustinfer: the {dead[0]} exited with code {dead[1]} during start-up", file=sys.stderr)
                return 1
            ready, status = _ready_status(client, cluster.url)
            if ready:
                return 0
            if status and status != last:
                print(f"rustinfer: {status}", file=sys.stderr, flush=True)
                last = status
            if time.monotonic() > deadline:
                print(f"rustinfer: not ready after {cluster.config.ready_timeout_secs:.0f} s", file=sys.stderr)
                return 1
            time.sleep(0.25)
    # stopped on request before it was ready (maybe just before this loop saw it): SIGTERM is a clean stop
    return 130 if signal.SIGINT in stopping else 0


class WorkerRestarts:
    """The restart budget: at most `worker_max_restarts` within `worker_restart_window_secs`, the n-th restart of
    the window after `worker_restart_backoff_secs * 2**(n-1)` (a worker that dies at once is not restarted in a
    tight loop, one that died an hour ago does not count)."""

    def __init__(self, config: Config) -> None:
        self.max = config.worker_max_restarts
        self.window = config.worker_restart_window_secs
        self.backoff = config.worker_restart_backoff_secs
        self.times: deque[float] = deque()  # when each restart within the window was decided

    def next_delay(self, now: float) -> float | None:
        """The delay before the next restart, and it is counted; None when the budget is spent."""
        while self.times and now - self.times[0] >= self.window:
            self.times.popleft()
        if len(self.times) >= self.max:
            return None
        self.times.append(now)
        return self.backoff * 2 ** (len(self.times) - 1)


def _supervise(cluster: Cluster, stopping: list[int]) -> int:
    """Watch the processes until a stop is asked (0) or the cluster cannot go on (1, saying why)."""
    cfg = cluster.config
    restarts = WorkerRestarts(cfg)
    restart_at: float | None = None  # a dead worker's replacement is due then
    recovering = False  # a replacement started and /ready has not said 200 since
    with httpx.Client() as client:
        while not stopping:
            now = time.monotonic()
            dead = cluster.dead(skip=("worker",))
            if dead is not None:
                print(f"rustinfer: the {dead[0]} exited with code {dead[1]}; stopping the others", file=sys.stderr)
                return 1
            code = cluster.procs["worker"].poll()
            if code is not None and restart_at is None:
                delay = restarts.next_delay(now)
                if delay is None:
                    why = ("restarts are off (worker_max_restarts = 0)" if not cfg.worker_max_restarts else
                           f"it was restarted {len(restarts.times)} times in the last "
                           f"{cfg.worker_restart_window_secs:g} s already (worker_max_restarts = "
                           f"{cfg.worker_max_restarts}, worker_restart_window_secs = "
                           f"{cfg.worker_restart_window_secs:g})")
                    print(f"rustinfer: the worker exited with code {code}, and {why}: giving up; stopping the others",
                          file=sys.stderr, flush=True)
                    return 1
                print(f"rustinfer: the worker exited with code {code}; its requests failed (worker_lost); "
                      f"restarting it in {delay:g} s (restart {len(restarts.times)} of at most "
                      f"{cfg.worker_max_restarts} within {cfg.worker_restart_window_secs:g} s)",
                      file=sys.stderr, flush=True)
                restart_at = now + delay
            if restart_at is not None and now >= restart_at:
                restart_at = None
                recovering = True
                cluster.restart_worker()
            if recovering and _ready_status(client, cluster.url)[0]:
                recovering = False
                print("rustinfer: the restarted worker is ready; serving again", file=sys.stderr, flush=True)
            time.sleep(0.2)
    return 0


def serve(config: Config) -> int:
    sched = config.ipc_path("sched")
    if ipc_listener(sched):
        # Its scheduler would refuse to start, but by then this cluster's worker would have joined the running one
        # (and leaving, taken it down as a lost worker): refuse before anything starts.
        path = sched.removeprefix("ipc://")
        print(f"rustinfer: error: another cluster is serving cluster_id {config.cluster_id!r} ({path}); stop it or "
              "start this one with a different --cluster-id", file=sys.stderr)
        return 1
    cluster = Cluster(config)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    cluster.start()
    try:
        code = _wait_ready(cluster, stopping)
        if code or stopping:
            return code
        print(f"rustinfer: ready — OpenAI-compatible API at {cluster.url}/v1 (Ctrl-C to stop)", flush=True)
        return _supervise(cluster, stopping)
    finally:
        cluster.stop()


def _version() -> str:
    """The installed distributions' versions (from their metadata: nothing is imported)."""
    versions = []
    for dist in ("rustinfer", *WORKSPACE_PACKAGES):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:  # infer-backend-cuda is not installed on macOS
            pass
    return f"{versions[0]} ({', '.join(versions[1:])})" if len(versions) > 1 else versions[0]


def main(argv: list[str] | None = None) -> None:
    # raw text: argparse would wrap the --version line like a paragraph
    parser = argparse.ArgumentParser(prog="rustinfer", description="RustInfer: OpenAI-compatible LLM serving",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start scheduler, worker and server together",
                       description="Start scheduler, worker and server on one config. Precedence: defaults < "
                                   "--config file < RUSTINFER_<FIELD> environment variables < flags.")
    add_config_arguments(s)
    args = parser.parse_args(argv)
    try:
        config = load_config_from_args(args)
    except ConfigError as exc:
        print(f"rustinfer: {exc}", file=sys.stderr)
        sys.exit(2)
    if config.model:
        _fetch_model(config)
    sys.exit(serve(config))


def _fetch_model(config: Config) -> None:
    """Find the model (or download it, with huggingface_hub's progress bars) before any process starts, so a
    wrong name or a missing download is the first thing printed; the worker later finds it in the cache."""
    try:
        resolve_model_source(config.model, config.revision)
    except ModelSourceError as exc:
        print(f"rustinfer: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C during a download: huggingface_hub resumes it next time
        print(f"\nrustinfer: interrupted while fetching {config.model}", file=sys.stderr)
        sys.exit(130)
