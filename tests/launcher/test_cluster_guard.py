"""`rustinfer serve` on a cluster_id another cluster serves: refused before any process starts. (Its scheduler
would refuse too, but its worker, started beside it, would join the running cluster and, leaving, take that
cluster's worker down as lost: seen on 2026-12-03 with two `rustinfer serve` on the default cluster_id.)"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from infer_protocol.config import Config, ipc_listener
from infer_scheduler.service import Service
from rustinfer import launcher


def test_serve_refuses_a_cluster_id_a_running_scheduler_serves(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = tempfile.mkdtemp(prefix="ri-guard-")  # short: unix socket paths are limited to ~100 bytes
    config = Config(cluster_id=f"guard{os.getpid()}", ipc_dir=d, ready_timeout_secs=20.0)
    started: list[str] = []
    monkeypatch.setattr(launcher.Cluster, "start", lambda self: started.append("started"))
    running = Service(config)  # a real scheduler of that cluster, its sockets bound
    try:
        assert ipc_listener(config.ipc_path("sched"))
        assert launcher.serve(config) == 1
        assert started == []  # nothing was started
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("rustinfer: error: another cluster is serving cluster_id")
        assert f"'{config.cluster_id}'" in err and "--cluster-id" in err
        assert ipc_listener(config.ipc_path("sched"))  # the running one untouched
    finally:
        running.close()
        shutil.rmtree(d, ignore_errors=True)
    assert not ipc_listener(config.ipc_path("sched"))  # once it is gone, the cluster_id is free again
