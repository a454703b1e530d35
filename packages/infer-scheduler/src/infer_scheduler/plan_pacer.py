"""When the one-step-ahead pipeline's next plan should leave: held until shortly before the worker needs it.

With `enable_overlap` the plan of step k+1 goes out the moment step k starts, so a request arriving while step k
runs misses step k+1 and waits for k+2: about one whole step on its TTFT (a 500-token chunk's step is ~11 ms).
Held until the running step is predicted to end, less the host time the plan needs to reach the device (the
scheduler's planning and the worker's launch, both measured) and `plan_slack_ms`, the plan takes in whatever
arrived meanwhile, and the worker still has it queued before the device runs dry.

A step starts when the step before it ends on the device, which the scheduler sees as that step's result arriving
(both ends carry the same read-back and ZMQ hop, so their difference is the device time). Durations are learned
per step size (total tokens, to the next power of two: the padded CUDA-graph buckets cost alike), only from steps
that were queued behind another (a step sent to an idle worker starts at an unseen moment). A wrong prediction
costs little: too short, the plan leaves early (as without the pacer); too long, the step's result arrives first,
nothing is in flight any more, and the plan leaves at once, as in the synchronous pipeline.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

_WEIGHT = 0.25  # each measurement's share of its size's running estimate


def size_key(num_tokens: int) -> int:
    """The step-size class of a step computing `num_tokens` tokens: the next power of two."""
    return 1 << max(0, num_tokens - 1).bit_length()


class _Flight(NamedTuple):
    step: int
    key: int
    queued: bool  # sent while another step was in flight: it starts when that one's result arrives
    started: float | None = None  # on the device, as seen here; None: not yet, or not observed (an idle worker's)


class PlanPacer:
    """Tracks the steps in flight and their measured durations; says when the next plan is due."""

    def __init__(self, slack_ms: float) -> None:
        self.slack = slack_ms / 1e3
        self._flights: deque[_Flight] = deque()
        self._estimate: dict[int, float] = {}  # size key -> running duration estimate (s)
        self._last: dict[int, float] = {}  # size key -> the latest measured duration (s)

    def reset(self) -> None:
        """Forget the steps in flight (a failed step, a lost worker); the learned durations stay."""
        self._flights.clear()

    def sent(self, step: int, num_tokens: int) -> None:
        """A plan went to the worker. Queued behind a step, it starts when that one ends (`finished`)."""
        self._flights.append(_Flight(step, size_key(num_tokens), bool(self._flights)))

    def finished(self, step: int, now: float) -> None:
        """Step `step`'s result (or failure) arrived at `now`: it ended, and the step queued behind it started."""
        while self._flights and self._flights[0].step <= step:
            done = self._flights.popleft()
            if done.step == step and done.started is not None:
                self._learn(done.key, now - done.started)
        if self._flights and self._flights[0].queued and self._flights[0].started is None:
            self._flights[0] = self._flights[0]._replace(started=now)

    def _learn(self, key: int, seconds: float) -> None:
        old = self._estimate.get(key)
        self._estimate[key] = seconds if old is None else old + (seconds - old) * _WEIGHT
        self._last[key] = seconds

    def due(self, host_lead: float) -> float | None:
        """When the next plan should leave (a `now`-clock time), or None for at once: no step, or more than one,
        in flight, or the running step's start or duration unknown. `host_lead` (s): the measured time from
        planning to the step queued on the device."""
        if len(self._flights) != 1:
            return None
        running = self._flights[0]
        if running.started is None or running.key not in self._estimate:
            return None
        duration = min(self._estimate[running.key], self._last[running.key])
        return running.started + duration - host_lead - self.slack
