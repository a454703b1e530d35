"""State slots of hybrid models: the pool refuses misuse at once, the engine hands one slot to each admitted
request (turning prefix caching off), and a budget of fewer slots than requests only queues them."""

from __future__ import annotations

import logging

import pytest

from infer_protocol.config import Config
from infer_protocol.messages import ModelInfo, Ready
from infer_scheduler.engine import Engine
from infer_scheduler.kv_manager import KvCacheManager
from infer_scheduler.state_slots import SlotError, StateSlotPool

from .conftest import make_engine, make_submit
from .sim_worker import SimWorker, run_to_completion


def test_pool_hands_out_1_to_n_and_refuses_double_free_and_overdraw() -> None:
    pool = StateSlotPool(2)
    a, b = pool.take(), pool.take()
    assert {a, b} == {1, 2} and pool.num_free == 0
    with pytest.raises(SlotError):
        pool.take()
    pool.free(a)
    with pytest.raises(SlotError):
        pool.free(a)
    with pytest.raises(SlotError):
        pool.free(0)  # the worker's scratch slot is never a request's
    pool.check([b])
    with pytest.raises(SlotError):
        pool.check([b, b])


def test_prefix_caching_and_state_slots_do_not_mix() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        KvCacheManager(8, 4, enable_prefix_caching=True, num_state_slots=2)


def test_engine_turns_prefix_caching_off_for_a_worker_with_state_slots(caplog: pytest.LogCaptureFixture) -> None:
    ready = Ready(num_blocks=32, block_size=4, model=ModelInfo("/m", 256, 100, "cpu", "cpu", "float32"),
                  num_state_slots=3)
    with caplog.at_level(logging.WARNING, logger="infer_scheduler.engine"):
        engine = Engine.from_config(Config(enable_prefix_caching=True), ready)
    assert engine.kv.cache is None and engine.kv.slots is not None and engine.kv.slots.num_slots == 3
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)


def test_one_slot_serves_requests_one_at_a_time_and_every_slot_comes_back() -> None:
    engine = make_engine(num_blocks=64, enable_prefix_caching=False, num_state_slots=1, max_inflight_steps=2)
    worker = SimWorker(64, 4, num_state_slots=1)
    for i in range(3):
        assert engine.submit(make_submit([1, 2, 3, 4, 5], max_tokens=4, rid=f"s{i}")) is None
    outputs = run_to_completion(engine, worker)
    assert sorted(outputs) == ["s0", "s1", "s2"]
    assert all(sum(len(o.token_ids) for o in outs) == 4 for outs in outputs.values())
    admitted = [ns for plan in worker.plans for ns in plan.new_seqs]
    assert [ns.state_slot for ns in admitted] == [1, 1, 1]
    # never two at once: each admission comes after the one before was forgotten
    running_after = [len(plan.new_seqs) + len(plan.continuing) for plan in worker.plans]
    assert max(running_after) == 1
    assert engine.kv.slots is not None and engine.kv.slots.num_free == 1
