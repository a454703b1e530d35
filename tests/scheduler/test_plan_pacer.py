"""PlanPacer: when the one-step-ahead pipeline's next plan is due, from the steps' measured durations."""

from __future__ import annotations

import pytest

from infer_scheduler.plan_pacer import PlanPacer, size_key


def test_size_key_is_the_next_power_of_two():
    assert [size_key(n) for n in (0, 1, 2, 3, 12, 16, 17, 500, 512, 513)] == [1, 1, 2, 4, 16, 16, 32, 512, 512, 1024]


def test_nothing_is_held_before_a_queued_step_was_measured():
    pacer = PlanPacer(slack_ms=1.0)
    assert pacer.due(0.0) is None  # nothing in flight
    pacer.sent(1, 12)  # to an idle worker: its start is not seen, so it is never measured
    assert pacer.due(0.0) is None
    pacer.sent(2, 12)  # queued behind step 1
    assert pacer.due(0.0) is None  # two in flight: the pipeline is full
    pacer.finished(1, now=10.0)  # step 2 starts at 10.0, but no 16-token step has been measured yet
    assert pacer.due(0.0) is None
    pacer.sent(3, 12)
    pacer.finished(2, now=10.008)  # 8 ms
    assert pacer.due(0.002) == pytest.approx(10.008 + 0.008 - 0.002 - 0.001)


def test_the_estimate_is_per_size_and_never_above_the_latest_measurement():
    pacer = PlanPacer(slack_ms=0.0)
    pacer.sent(1, 1)
    pacer.sent(2, 1)
    now = 0.0
    pacer.finished(1, now)
    durations = {2: 0.004, 3: 0.004, 4: 0.012, 5: 0.003}  # step 4 (500 tokens) is another size class
    sizes = {3: 1, 4: 500, 5: 1, 6: 1}
    for step in (2, 3, 4, 5):
        pacer.sent(step + 1, sizes[step + 1])
        now += durations[step]
        pacer.finished(step, now)
        if step == 3:  # the 500-token step 4 runs now: unknown size, nothing held
            assert pacer.due(0.0) is None
    # step 6 (1 token) runs since `now`: the 1-token estimate is 4, 4, 3 ms averaged, capped by the latest (3 ms)
    assert pacer.due(0.0) == pytest.approx(now + 0.003)
    pacer.sent(7, 500)
    pacer.finished(6, now + 0.004)
    assert pacer.due(0.0) == pytest.approx(now + 0.004 + 0.012)  # step 7: the 500-token size's 12 ms


def test_a_failed_step_and_a_reset_leave_nothing_held():
    pacer = PlanPacer(slack_ms=0.0)
    for step in (1, 2):
        pacer.sent(step, 4)
    pacer.finished(1, now=1.0)
    pacer.sent(3, 4)
    pacer.finished(2, now=1.005)
    assert pacer.due(0.0) == pytest.approx(1.010)
    pacer.finished(3, now=1.006)  # a failure: its result never comes, the service reports it finished
    assert pacer.due(0.0) is None
    pacer.sent(4, 4)  # to an idle worker again
    pacer.sent(5, 4)
    pacer.reset()  # the worker was lost
    assert pacer.due(0.0) is None
    pacer.finished(5, now=2.0)  # a late result of the lost worker's changes nothing
    assert pacer.due(0.0) is None
