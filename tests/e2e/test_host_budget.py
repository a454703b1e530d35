"""bench/host_budget.py against the three real processes: each one's CPU time per step, and the step timings the
scheduler reports in /metrics, measured while requests run."""

from __future__ import annotations

import asyncio

import httpx

from tests.bench.scripts import load_bench_script
from tests.e2e.cluster import ServedCluster

host_budget = load_bench_script("host_budget")


def test_host_budget_measures_each_process_per_step(tiny_cluster: ServedCluster) -> None:
    url = tiny_cluster.url
    body = {"model": "tiny", "prompt": [1, 450, 7042, 282], "temperature": 0, "max_tokens": 200, "ignore_eos": True}

    async def drive() -> dict:
        async with host_budget.HostBudget(url, interval=0.05, pids={role: [pid] for role, pid in tiny_cluster.pids().items()}) as budget:
            async with httpx.AsyncClient(timeout=120) as client:
                resps = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(4)))
            assert all(r.status_code == 200 for r in resps)
        return budget.report

    report = asyncio.run(drive())
    assert report["steps"] >= 200  # 4 requests of 200 tokens, batched: at least one step per token
    cpu = report["cpu_ms_per_step"]
    assert set(cpu) == {"server", "scheduler", "worker"} and all(ms > 0 for ms in cpu.values()), report
    assert 1 <= report["mean_running"] <= 4, report
    # The worker's step includes its launch; on the CPU backend the forward runs inside the launch.
    assert 0 < report["worker_launch_ms"] <= report["worker_step_ms"] * 1.5, report
    assert report["scheduler_plan_ms"] > 0 and report["scheduler_apply_ms"] > 0, report
    assert "worker" in host_budget.describe(report)
