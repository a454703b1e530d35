"""Test-only fault injection: a Python error in one step, triggered by a client through a token id.

`INFER_WORKER_FAULT_ON_TOKEN=<token id>` (read once at worker start-up; not a config field, and not under the
config loader's `RUSTINFER_` prefix, which refuses unknown names) makes a step raise while it is prepared when
the prompt tokens one of its sequences computes in it hold that id (so a long prompt with the id near its end
fails at its last chunk, after earlier chunks ran). The e2e tests use it to check
fault containment through the three real processes: the step's requests fail, the worker goes on. With
`INFER_WORKER_FAULT_KIND=device` the step instead gathers out of bounds on the backend's device: on a GPU a real
device-side assert, which must end the worker (and `rustinfer serve` restart it) rather than wedge it. Never set
either in production: any prompt with that token would fail.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from infer_worker.application.worker_service import LaunchedWork, StepExecutor
from infer_worker.domain.sequence import ScheduledSeq

FAULT_ENV = "INFER_WORKER_FAULT_ON_TOKEN"
FAULT_KIND_ENV = "INFER_WORKER_FAULT_KIND"
FAULT_KINDS = ("python", "device")


class InjectedFault(RuntimeError):
    """The error the fault injection raises (a Python error, not a device fault)."""


class FaultInjectingExecutor:
    def __init__(self, executor: StepExecutor, token_id: int, kind: str = "python", device: str = "cpu") -> None:
        self._executor = executor
        self.token_id = token_id
        self.kind = kind
        self._device = device

    def launch(self, scheduled: Seq[ScheduledSeq]) -> LaunchedWork:
        for item in scheduled:
            seq = item.seq
            end = min(seq.num_computed + item.num_new, seq.prompt_len)
            if self.token_id in seq.token_ids[seq.num_computed:end]:
                if self.kind == "device":  # read back at once, so the error surfaces in this step
                    out_of_bounds = torch.tensor([1 << 20], device=self._device)
                    torch.zeros(1, device=self._device)[out_of_bounds].tolist()
                raise InjectedFault(f"fault injected ({FAULT_ENV}={self.token_id}) for sequence {seq.seq_id}")
        return self._executor.launch(list(scheduled))


def with_fault_injection(executor: StepExecutor, env_value: str | None, kind: str | None = None,
                         device: str = "cpu") -> StepExecutor:
    """`executor` itself, or wrapped when the environment asks for a fault (`env_value`: the variable's value)."""
    if not env_value:
        return executor
    try:
        token_id = int(env_value)
    except ValueError:
        raise ValueError(f"{FAULT_ENV} must be a token id, got {env_value!r}") from None
    if (kind or "python") not in FAULT_KINDS:
        raise ValueError(f"{FAULT_KIND_ENV} must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    return FaultInjectingExecutor(executor, token_id, kind or "python", device)
