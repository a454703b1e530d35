"""bench/ablate_step.py's model surgery on the CPU backend: it finds every linear by its attribute name, knows each
one's output width in every weight layout, makes the named GEMM free inside the context only, and restores the model
exactly on exit (the GPU replays themselves run on the device)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.bench.scripts import load_bench_script
from tests.worker.quant_checkpoints import awq_config, write_quantized
from tests.worker.tiny_checkpoints import Engine, llama_config, qwen3_config, random_hf_model, write_checkpoint

ablate = load_bench_script("ablate_step")
PROMPT = [5, 17, 42, 9, 3, 77, 120, 8]


def _widths(config) -> dict[str, int]:  # noqa: ANN001 - an HF config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"qkv_proj": (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim,
            "o_proj": config.hidden_size, "gate_up_proj": 2 * config.intermediate_size,
            "down_proj": config.hidden_size, "lm_head": config.vocab_size}


def test_each_linear_found_by_name_with_its_output_width_dense_and_awq(tmp_path: Path) -> None:
    config = llama_config(hidden_size=128, intermediate_size=256)
    write_checkpoint(config, tmp_path / "dense")
    write_quantized(random_hf_model(config, seed=3).state_dict(), config.to_dict(), tmp_path / "awq", awq_config(32),
                    torch.float32)
    for name in ("dense", "awq"):
        engine = Engine.open(tmp_path / name)
        found = ablate.named_linears(engine.model)
        assert len(found) == 4 * config.num_hidden_layers + 1  # four a layer, and the head
        assert {attr: ablate.out_features(lin) for attr, lin in found} == _widths(config), name
        layouts = {type(lin.params.tensors.get("qweight")) for attr, lin in found if attr != "lm_head"}
        assert layouts == ({torch.Tensor} if name == "awq" else {type(None)})


class CountingOps:
    """A linear's ops that count the GEMMs they run, by the linear's attribute name."""

    def __init__(self, ops, attr: str, calls: Counter) -> None:  # noqa: ANN001 - a LinearOps
        self._ops, self._attr, self._calls = ops, attr, calls

    def __getattr__(self, name: str):  # noqa: ANN204 - the wrapped method
        method = getattr(self._ops, name)

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self._calls[self._attr] += 1
            return method(*args, **kwargs)
        return counted


@pytest.mark.parametrize("part", ["o_proj", "gate_up_proj", "lm_head", "gemms"])
def test_a_part_is_free_inside_the_context_and_restored_after(part: str, tmp_path: Path) -> None:
    """Inside, the named linears run no GEMM (their output has the GEMM's shape) and every other one does; after,
    all of them run again and the logits are the untouched model's, bit for bit."""
    config = qwen3_config(tied=False)
    write_checkpoint(config, tmp_path)
    engine = Engine.open(tmp_path)
    calls: Counter = Counter()
    for attr, lin in ablate.named_linears(engine.model):
        lin._ops = CountingOps(lin._ops, attr, calls)
    names = set(_widths(config))
    freed = names if part == "gemms" else {part}
    before = engine.prefill_logits(PROMPT)
    assert set(calls) == names
    calls.clear()
    with ablate.ablated(part, engine.model, engine.runner.backend.ops.fused):
        during = engine.prefill_logits(PROMPT)
    assert set(calls) == names - freed
    assert during.shape == before.shape
    calls.clear()
    after = engine.prefill_logits(PROMPT)
    assert set(calls) == names
    assert torch.equal(after, before)


def test_an_unknown_part_is_refused_with_the_linears_there_are(tmp_path: Path) -> None:
    write_checkpoint(llama_config(), tmp_path)
    engine = Engine.open(tmp_path)
    with pytest.raises(SystemExit, match=r"no part 'v_proj': linears are \['down_proj', 'gate_up_proj', 'lm_head', "
                                         r"'o_proj', 'qkv_proj'\]"):
        with ablate.ablated("v_proj", engine.model, engine.runner.backend.ops.fused):
            pass
