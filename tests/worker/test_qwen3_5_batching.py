"""Continuous batching of a hybrid model in one process: the real scheduler Engine drives the real WorkerService
over the eager CPU runner on a tiny Qwen3.5. Requests arrive staggered and each gets the tokens it gets alone —
also when a tight block budget preempts (its state is rebuilt by recompute from a zeroed slot) and when fewer
state slots than requests make them wait for one."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer_backend_cpu import CpuBackend
from infer_protocol.messages import SamplingParams, Submit
from infer_worker.application.model_runner import ModelRunner
from tests.worker.qwen3_5_checkpoints import load_hybrid, write_qwen3_5
from tests.worker.test_overlap_pipeline import BLOCK_SIZE, MAX_BLOCKS_PER_SEQ, serve

SLOTS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5-batching")
    write_qwen3_5(path, seed=11)
    return path


def hybrid_runner(model_dir: Path, num_blocks: int) -> ModelRunner:
    backend = CpuBackend()
    model, caches = load_hybrid(model_dir, backend, num_blocks, BLOCK_SIZE, SLOTS)
    return ModelRunner(model, backend, caches.per_layer, BLOCK_SIZE, MAX_BLOCKS_PER_SEQ, backend.device,
                       state_pools=caches.state_pools)


def requests() -> list[Submit]:
    greedy = SamplingParams(temperature=0.0)
    return [Submit(request_id=f"q{i}", prompt_token_ids=[(31 * i + 7 * j) % 250 + 1 for j in range(3 + 4 * i)],
                   sampling=greedy, max_tokens=6 + 3 * (i % 3)) for i in range(5)]


@pytest.fixture(scope="module")
def solo(model_dir: Path) -> dict[str, list[int]]:
    runner = hybrid_runner(model_dir, num_blocks=64)
    tokens = {}
    for sub in requests():
        out, _ = serve(runner, [sub], overlap=False, num_blocks=64, initial=1, num_state_slots=SLOTS,
                       enable_prefix_caching=False)
        tokens[sub.request_id] = out[sub.request_id][0]
    return tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_staggered_arrivals_get_their_solo_tokens(model_dir: Path, solo: dict[str, list[int]], overlap: bool) -> None:
    runner = hybrid_runner(model_dir, num_blocks=64)
    out, engine = serve(runner, requests(), overlap=overlap, num_blocks=64, initial=2, num_state_slots=SLOTS)
    assert engine.kv.cache is None  # prefix caching turned off for the hybrid model
    assert {rid: toks for rid, (toks, _) in out.items()} == solo


@pytest.mark.parametrize(("num_blocks", "slots"), [(10, SLOTS), (64, 2)], ids=["tight-blocks", "tight-slots"])
def test_preemption_or_a_tight_slot_budget_keeps_the_solo_tokens(model_dir: Path, solo: dict[str, list[int]],
                                                                 num_blocks: int, slots: int) -> None:
    """10 blocks of 4 hold far less than the five requests together (preemption, then recompute into a zeroed
    slot); or 2 slots serve five requests (each waits for a slot)."""
    runner = hybrid_runner(model_dir, num_blocks=num_blocks)
    out, engine = serve(runner, requests(), overlap=True, num_blocks=num_blocks, initial=3, num_state_slots=slots,
                        enable_prefix_caching=False)
    if slots == SLOTS:
        assert engine.counters.preemptions > 0
    assert {rid: toks for rid, (toks, _) in out.items()} == solo
    assert engine.kv.slots is not None and engine.kv.slots.num_free == slots
