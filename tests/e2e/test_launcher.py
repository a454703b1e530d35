"""`rustinfer serve` keeps the three processes alive together and tears them down together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.cluster import ServedCluster
from tests.worker.hub_cache import offline_env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_dead_worker_stops_the_cluster_and_is_named(tmp_path: Path, embedded_model_dir: Path) -> None:
    """With restarts off (worker_max_restarts = 0); the restarts are tests/e2e/test_supervisor.py's."""
    cluster = ServedCluster(tmp_path, max_model_len=1024, worker_max_restarts=0).start()
    pids = cluster.pids()
    assert set(pids) == {"scheduler", "worker", "server"}, cluster.log()
    os.kill(pids["worker"], signal.SIGKILL)
    assert cluster.proc is not None
    code = cluster.proc.wait(timeout=60)
    assert code != 0
    assert "the worker exited" in cluster.log() and "restarts are off" in cluster.log()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids.values())


def test_sigterm_tears_all_three_down(tmp_path: Path, embedded_model_dir: Path) -> None:
    cluster = ServedCluster(tmp_path, max_model_len=1024).start()
    pids = cluster.pids()
    assert httpx.get(f"{cluster.url}/ready").status_code == 200
    assert cluster.stop() == 0
    assert not any(_alive(p) for p in pids.values())


def test_bad_flags_give_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("max_batch_seqs = -1\n")
    cases = [
        (["serve", "--config", str(bad)], "max_batch_seqs"),
        (["serve", "--model", str(tmp_path / "nope")], "model directory not found"),
        (["serve", "--backend", "tpu", "--port", "99999"], "port"),
    ]
    for args, needle in cases:
        result = subprocess.run([sys.executable, "-c", "from rustinfer.launcher import main; main()", *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result
        assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_an_unservable_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    """An architecture we do not serve (Qwen3-Next): the worker's refusal names it, on one line of the launcher's
    output, and the launcher exits."""
    import json

    import pytest

    from tests.worker.test_bootstrap import OTHER_CONFIG

    model_dir = tmp_path / "qwen3_next"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(OTHER_CONFIG))
    cluster = ServedCluster(tmp_path, model=str(model_dir), log_level="info")
    with pytest.raises(RuntimeError, match="cluster exited"):
        cluster.start(timeout=120)
    needle = ("start-up failed: model architecture Qwen3NextForCausalLM (model_type qwen3_next) is not "
              "supported; supported: LlamaForCausalLM, Qwen3ForCausalLM, Qwen3_5ForCausalLM, "
              "Qwen3_5ForConditionalGeneration")
    lines = [line for line in cluster.log().splitlines() if "start-up failed" in line]
    assert any(line.endswith(needle) for line in lines), cluster.log()
    cluster.stop()


def test_a_hub_id_missing_offline_stops_the_launcher_before_any_process(tmp_path: Path) -> None:
    """The console script as a user runs it: offline with an empty cache, a Hub id is refused in one line naming
    the id and the cache directory, before any of the three processes starts."""
    result = subprocess.run([str(Path(sys.executable).parent / "rustinfer"), "serve", "--model", "owner/missing"],
                            capture_output=True, text=True, timeout=120, env=offline_env(tmp_path))
    assert result.returncode == 2, result
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("rustinfer: ") and "owner/missing" in line and str(tmp_path / "hub") in line, line


def test_the_restart_budget_backs_off_and_forgets_old_restarts() -> None:
    from infer_protocol.config import Config
    from rustinfer.launcher import WorkerRestarts

    budget = WorkerRestarts(Config(worker_max_restarts=3, worker_restart_window_secs=60.0,
                                   worker_restart_backoff_secs=1.0))
    assert [budget.next_delay(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 4.0]
    assert budget.next_delay(30.0) is None  # a fourth death within 60 s of the first restart
    assert budget.next_delay(60.5) == 4.0  # the first restart has left the window: one is free again
    assert WorkerRestarts(Config(worker_max_restarts=0)).next_delay(0.0) is None
