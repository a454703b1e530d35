"""The per-step host-time budget, as moving averages the scheduler reports in every Pong (and so in /metrics)."""

from __future__ import annotations

import msgspec

from infer_protocol.messages import SchedulerStats

_WEIGHT = 0.05  # each step's share of the average: about the last 20-40 steps dominate


class StepTimings:
    def __init__(self) -> None:
        self.plan_ms = 0.0
        self.apply_ms = 0.0
        self.worker_launch_ms = 0.0
        self.worker_step_ms = 0.0

    def planned(self, plan_ms: float) -> None:
        self.plan_ms += (plan_ms - self.plan_ms) * _WEIGHT

    def result_applied(self, apply_ms: float, worker_launch_ms: float, worker_step_ms: float) -> None:
        self.apply_ms += (apply_ms - self.apply_ms) * _WEIGHT
        self.worker_launch_ms += (worker_launch_ms - self.worker_launch_ms) * _WEIGHT
        self.worker_step_ms += (worker_step_ms - self.worker_step_ms) * _WEIGHT

    def add_to(self, stats: SchedulerStats) -> SchedulerStats:
        return msgspec.structs.replace(stats, plan_ms=self.plan_ms, apply_ms=self.apply_ms,
                                       worker_launch_ms=self.worker_launch_ms, worker_step_ms=self.worker_step_ms)
