"""`rustinfer-server`: config errors exit 2 with one line; a real process serves once the scheduler is ready."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from infer_protocol.config import load_config
from infer_server.cli import main
from infer_server.tokenizer import Tokenizer
from tests.server.conftest import free_port, marker_responder
from tests.server.fake_scheduler import FakeScheduler


def test_missing_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rustinfer-server: error: config file not found")


def test_invalid_field_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("prot = 80\n")
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prot" in err


def test_server_process(model_dir: Path, tokenizer: Tokenizer) -> None:
    ipc_dir = tempfile.mkdtemp(prefix="ri-")
    port = free_port()
    cfg_path = Path(ipc_dir) / "c.toml"
    cfg_path.write_text(
        f'cluster_id = "c{uuid.uuid4().hex[:8]}"\nipc_dir = "{ipc_dir}"\nport = {port}\n'
        'heartbeat_interval_secs = 0.05\nlog_level = "warning"\n'
    )
    config = load_config(cfg_path, environ={})
    fake = FakeScheduler(config, str(model_dir), marker_responder(tokenizer), vocab_size=tokenizer.vocab_size)
    fake.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUSTINFER_")}
    proc = subprocess.Popen([sys.executable, "-m", "infer_server.cli", "--config", str(cfg_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "server process not ready"
            time.sleep(0.05)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        proc.terminate()
        rc = proc.wait(15)
        fake.stop()
    assert rc == 0  # SIGTERM: a clean, graceful exit
