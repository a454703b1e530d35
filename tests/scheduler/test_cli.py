"""`rustinfer-scheduler --config FILE`: bad configs exit 2 with one line; SIGTERM exits cleanly after Shutdown."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from infer_protocol.config import Config, dump_config
from infer_scheduler.cli import main

from .standin import FakeServer, StandInWorker


def test_bad_config_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("max_batch_tokens = -1\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("rustinfer-scheduler: error:") and "max_batch_tokens" in err
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("no_such_field = 1\n")
    assert main(["--config", str(unknown)]) == 2


def test_sigterm_exits_cleanly_after_shutting_the_worker_down():
    d = tempfile.mkdtemp(prefix="ri-cli-")
    try:
        cfg = Config(cluster_id=f"cli{os.getpid()}", ipc_dir=d, heartbeat_interval_secs=0.05, log_level="info")
        path = os.path.join(d, "c.toml")
        with open(path, "w") as fh:
            fh.write(dump_config(cfg))
        proc = subprocess.Popen([sys.executable, "-m", "infer_scheduler", "--config", path],
                                stderr=subprocess.PIPE, text=True)
        worker = StandInWorker(cfg)
        worker.start()
        srv = FakeServer(cfg)
        try:
            deadline = time.monotonic() + 60  # a loaded 2-core CI machine starts Python slowly
            while True:
                try:
                    if srv.ping(timeout=2).ready:
                        break
                except TimeoutError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0, proc.stderr.read() if proc.stderr else ""
            assert worker.shutdown_received.wait(5), proc.stderr.read() if proc.stderr else ""
        finally:
            srv.close()
            worker.stop_now.set()
            worker.join(5)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(d, ignore_errors=True)
