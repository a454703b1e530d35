"""The per-step host (Python) budget of a running engine, measured from outside while a benchmark drives it.

For each of the three processes (found in /proc by their command line) the CPU time it spent during a window,
divided by the scheduler steps run in that window: the Python time per step of the server (HTTP + streaming),
the scheduler and the worker. The window also averages what the scheduler reports in /metrics every
heartbeat: the running batch, the scheduler's plan/apply time, the worker's launch time and the worker's step
time (plan taken -> result ready). Every host time must stay below the device step time, or the GPU waits.

    async with HostBudget(url) as budget: ...drive the server...
    budget.report  # dict, see HostBudget.report

Linux only (reads /proc).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
from pathlib import Path

import httpx

ROLES = ("server", "scheduler", "worker")
_SAMPLE = re.compile(r"^(rustinfer_[a-z_]+) ([-+0-9.eE]+)$", re.M)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def find_pids() -> dict[str, list[int]]:
    """The engine's processes by role (the launcher names each child `rustinfer-ROLE` / `infer_ROLE.cli`; there
    may be several server processes)."""
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for role in ROLES:
            if f"rustinfer-{role}" in cmdline or f"infer_{role}.cli" in cmdline or f"infer_{role} " in cmdline:
                found.setdefault(role, []).append(int(entry.name))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics", timeout=5)).text
    return {name: float(value) for name, value in _SAMPLE.findall(text)}


class HostBudget:
    def __init__(self, url: str, interval: float = 0.5, pids: dict[str, list[int]] | None = None,
                 settle: float = 1.2) -> None:
        self.url = url
        self.interval = interval
        self.settle = settle  # /metrics shows the scheduler's last Pong: wait for one sent after the work
        self.pids = pids if pids is not None else find_pids()  # one engine on the machine, or say which
        self.report: dict[str, object] = {}
        self._samples: list[dict[str, float]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HostBudget:
        self._client = httpx.AsyncClient()
        self._cpu0 = {role: sum(map(cpu_seconds, pids)) for role, pids in self.pids.items()}
        self._first = await scrape(self._client, self.url)
        self._task = asyncio.create_task(self._poll())
        return self

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self._samples.append(await scrape(self._client, self.url))
            except httpx.HTTPError:
                pass

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.sleep(self.settle)
        last = await scrape(self._client, self.url)
        cpu = {role: sum(map(cpu_seconds, pids)) - self._cpu0[role] for role, pids in self.pids.items()}
        await self._client.aclose()
        steps = last["rustinfer_scheduler_steps_total"] - self._first["rustinfer_scheduler_steps_total"]
        busy = [s for s in self._samples if s.get("rustinfer_num_requests_running", 0) > 0] or [last]

        def mean(name: str, scale: float = 1.0) -> float:
            return statistics.fmean(s.get(name, 0.0) for s in busy) * scale

        self.report = {
            "steps": steps,
            "mean_running": mean("rustinfer_num_requests_running"),
            "cpu_ms_per_step": {role: (1e3 * sec / steps if steps else float("nan")) for role, sec in cpu.items()},
            "scheduler_plan_ms": mean("rustinfer_step_plan_seconds", 1e3),
            "scheduler_apply_ms": mean("rustinfer_step_apply_seconds", 1e3),
            "worker_launch_ms": mean("rustinfer_step_worker_launch_seconds", 1e3),
            "worker_step_ms": mean("rustinfer_step_worker_step_seconds", 1e3),
        }


def describe(report: dict[str, object]) -> str:
    cpu = report["cpu_ms_per_step"]
    assert isinstance(cpu, dict)
    per = " ".join(f"{role} {ms:.2f}" for role, ms in cpu.items())
    return (f"batch ~{report['mean_running']:.0f}: CPU ms/step {per} | scheduler plan {report['scheduler_plan_ms']:.2f} "
            f"apply {report['scheduler_apply_ms']:.2f} | worker launch {report['worker_launch_ms']:.2f} "
            f"step {report['worker_step_ms']:.2f} ms")
