"""The hybrid cache at start-up: the Qwen3.5-4B benchmark config parses to the issue's facts, and a tiny variant
of it (same layout, small sizes) loads with dummy weights on CPU, sizes its KV blocks after the state slots
have taken their bytes, and serves a plan through the worker service."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer_core.dtypes import DType
from infer_protocol.config import Config
from infer_protocol.messages import NewSeq, SamplingParams, StepPlan
from infer_worker.application.cache_layout import state_geometry
from infer_worker.application.kv_sizing import KvGeometry
from infer_worker.infrastructure.bootstrap import bootstrap
from infer_worker.infrastructure.model_loader import read_spec
from infer_worker.models.spec import FULL_ATTENTION, LINEAR_ATTENTION

BENCH = Path(__file__).resolve().parents[2] / "bench" / "models" / "qwen3.5-4b"
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, vocab_size=512, max_position_embeddings=256)


def test_the_benchmark_config_is_qwen3_5_4b() -> None:
    spec = read_spec(BENCH)
    assert spec.architecture == "Qwen3_5ForConditionalGeneration"
    assert spec.mixers == ((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * 8
    assert (spec.hidden_size, spec.vocab_size, spec.intermediate_size, spec.head_dim, spec.rotary_dim) == (
        2560, 248320, 9216, 256, 64)
    assert (spec.num_heads, spec.num_kv_heads, spec.rope_theta, spec.tie_word_embeddings) == (16, 4, 1e7, True)
    la = spec.linear_attention
    assert la is not None and (la.num_k_heads, la.num_v_heads, la.k_head_dim, la.conv_dim, la.conv_kernel) == (
        16, 32, 128, 8192, 4)
    geometry = state_geometry(spec, DType.BFLOAT16)
    assert geometry is not None  # 24 layers x (8192 x 3 bf16 conv + 32 x 128 x 128 fp32): about 49 MiB a sequence
    assert geometry.bytes_per_slot == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


@pytest.fixture()
def tiny_dir(tmp_path: Path) -> Path:
    config = json.loads((BENCH / "config.json").read_text())
    text = config["text_config"]
    # (a head of 32 dims rotates 8: 4 frequencies, split over the three multimodal axes as 2, 1, 1)
    rope = {**text["rope_parameters"], "mrope_section": [2, 1, 1]}
    config["text_config"] = {**text, **TINY, "layer_types": text["layer_types"][:4], "rope_parameters": rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_tiny_variant_loads_dummy_weights_and_sizes_blocks_after_the_state_slots(tiny_dir: Path) -> None:
    budget, seqs, block_size = 300_000, 4, 4  # (few enough blocks that the useful cap, 4 x 64, is not reached)
    config = Config(model=str(tiny_dir), backend="cpu", load_format="dummy", dtype="float32",
                    cpu_kv_cache_bytes=budget, max_batch_seqs=seqs, block_size=block_size, max_model_len=256)
    ready = bootstrap(config, lambda _s: None)  # (its self-check ran a prefill and a decode in the scratch slot)
    spec = read_spec(tiny_dir)
    states = state_geometry(spec, DType.FLOAT32)
    assert states is not None and ready.num_state_slots == seqs
    kv = KvGeometry(spec.num_attention_layers, spec.num_kv_heads, spec.head_dim, block_size, 4)
    assert ready.num_blocks == (budget - (seqs + 1) * states.bytes_per_slot) // kv.bytes_per_block
    plan = StepPlan(step=1, new_seqs=[NewSeq(seq_id=1, token_ids=[5, 6, 7, 8, 9], num_computed=0, num_tokens=5,
                                             block_ids=[0, 1], sampling=SamplingParams(temperature=0.0),
                                             state_slot=seqs)])
    result = ready.service.step(plan)
    assert result.seq_ids == [1] and 0 <= result.token_ids[0] < 512


def test_state_slots_that_leave_no_room_for_blocks_name_max_batch_seqs(tiny_dir: Path) -> None:
    from infer_worker.application.assembly import StartupError

    config = Config(model=str(tiny_dir), backend="cpu", load_format="dummy", dtype="float32",
                    cpu_kv_cache_bytes=100_000, max_batch_seqs=8, block_size=4, max_model_len=256)
    with pytest.raises(StartupError, match="state slots of max_batch_seqs = 8 sequences take .* lower max_batch_seqs"):
        bootstrap(config, lambda _s: None)  # 9 slots of 16,896 bytes are more than the whole 100 kB budget


def test_the_warm_up_steps_run_past_the_mixed_graphs_in_blocks_of_their_own() -> None:
    from infer_worker.application.assembly import warm_eager_prefill

    class Recorder:
        def __init__(self, eager_min_tokens: int) -> None:
            self.eager_min_tokens, self.steps = eager_min_tokens, []

        def execute(self, scheduled: list) -> None:
            self.steps.append(scheduled)

    dense = Recorder(2049)  # mixed graphs up to 2048 tokens: the warm-up steps must be larger
    assert warm_eager_prefill(dense, [65, 129], 1000, 16, 10_000) == [65, 129]
    assert len(dense.steps) == 4  # each size: short queries only, then one long query among 2-token ones
    for step, size in zip(dense.steps, [65, 65, 129, 129]):
        assert len(step) == size and sum(s.num_new for s in step) >= 2049
        blocks = [b for s in step for b in s.seq.block_ids]
        assert len(blocks) == len(set(blocks)) and all(len(s.seq.block_ids) * 16 >= s.num_new for s in step)
        assert all(len(s.seq.token_ids) == s.num_new for s in step)
    for short, long in (dense.steps[0:2], dense.steps[2:4]):
        assert max(s.num_new for s in short) <= 2049 // 64 + 1  # every query its share of the step
        assert [s.num_new for s in long] == [2049] + [2] * (len(long) - 1)
    tight = Recorder(2049)  # 65 x 2 blocks fit 160, the long query's 129 blocks beside 64 more do not
    assert warm_eager_prefill(tight, [65], 1000, 16, 160) == [65]
    assert len(tight.steps) == 1 and [s.num_new for s in tight.steps[0]] == [32] * 65
    hybrid = Recorder(1)  # no mixed graphs: 2 tokens a sequence, one block each
    assert warm_eager_prefill(hybrid, [65, 129], 1000, 16, 100) == [65]  # 129 sequences need more than 100 blocks
    assert len(hybrid.steps) == 1 and [s.num_new for s in hybrid.steps[0]] == [2] * 65


def test_the_eager_prefill_warm_up_leaves_served_sequences_their_tokens(tiny_dir: Path) -> None:
    """The warm-up's 65 sequences run in the scratch state slot and write KV into blocks a sequence then takes:
    a sequence served after it gets the tokens it gets without it."""
    from infer_worker.application.assembly import warm_eager_prefill
    from infer_worker.application.model_runner import ModelRunner
    from infer_worker.domain.sequence import GREEDY, Sequence
    from infer_worker.infrastructure.backend_registry import create_backend
    from infer_worker.application.cache_layout import allocate_caches
    from infer_worker.infrastructure.model_loader import load_model
    from tests.worker.tiny_checkpoints import greedy_steps

    def served(warm: bool) -> list[int]:
        backend = create_backend("cpu", "cpu", DType.FLOAT32)
        model, spec = load_model(tiny_dir, backend, DType.FLOAT32, "dummy", 0)
        caches = allocate_caches(backend, spec, 80, 4, DType.FLOAT32, 2, spec.num_kv_heads)
        runner = ModelRunner(model, backend, caches.per_layer, 4, 8, "cpu", state_pools=caches.state_pools)
        if warm:
            assert warm_eager_prefill(runner, [65], 512, 4, 80) == [65]
        seq = Sequence(0, [5, 17, 33, 2, 9], 0, list(range(8)), GREEDY, state_slot=1)
        greedy_steps(runner, [seq], 6)
        return seq.token_ids[5:]

    assert served(warm=True) == served(warm=False)
