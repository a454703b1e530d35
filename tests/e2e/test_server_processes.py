"""`server_processes = 2`: two HTTP processes share the port (SO_REUSEPORT) in front of one scheduler; requests on
fresh connections all answer with the same greedy tokens, /metrics sums the processes' counters, and the launcher
stops all four processes cleanly."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import httpx
import pytest

from tests.bench.scripts import load_bench_script
from tests.e2e.cluster import ServedCluster

host_budget = load_bench_script("host_budget")

BODY = {"model": "tiny", "prompt": [1, 450, 7042, 282], "temperature": 0, "max_tokens": 6, "ignore_eos": True,
        "return_token_ids": True}


def test_two_server_processes_share_the_port(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = ServedCluster(tmp_path, model=str(tiny_model_dir), model_name="tiny", num_blocks=256, block_size=4,
                            max_model_len=256, server_processes=2)
    cluster.start(timeout=300)
    try:
        servers = set(cluster.pids_of("server"))
        assert len(servers) == 2, servers
        # Both become ready (each has its own scheduler connection): /ready answers 200 from whichever is hit.
        deadline = time.monotonic() + 30
        while sum(httpx.get(f"{cluster.url}/ready", timeout=5).status_code == 200 for _ in range(8)) < 8:
            assert time.monotonic() < deadline, "not every server process became ready"
            time.sleep(0.2)
        cpu_before = {pid: host_budget.cpu_seconds(pid) for pid in servers}
        with cf.ThreadPoolExecutor(8) as pool:  # httpx.post opens a fresh connection per call
            resps = list(pool.map(lambda _: httpx.post(f"{cluster.url}/v1/completions", json=BODY, timeout=120),
                                  range(25)))
        assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200]
        answers = {tuple(r.json()["choices"][0]["token_ids"]) for r in resps}
        assert len(answers) == 1 and len(next(iter(answers))) == 6
        # The kernel spread the connections: each process did a share of the work (its CPU time moved; an
        # idle server only answers pings).
        used = {pid: host_budget.cpu_seconds(pid) - cpu_before[pid] for pid in servers}
        assert min(used.values()) >= 0.1 * sum(used.values()) > 0, used
        # /metrics sums the processes' counters: whichever process answers, all 25 completions are there.
        for _ in range(12):
            text = httpx.get(f"{cluster.url}/metrics", timeout=5).text
            line = next(ln for ln in text.splitlines() if ln.startswith("rustinfer_http_requests_total")
                        and 'endpoint="/v1/completions"' in ln and 'status="200"' in ln)
            assert float(line.rsplit(" ", 1)[1]) == 25.0, line
            assert "rustinfer_num_requests_running" in text  # the scheduler's gauges are there too
    finally:
        assert cluster.stop() == 0, cluster.log()
    assert not set(cluster.pids_of("server"))
