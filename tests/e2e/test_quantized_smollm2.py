"""The real SmolLM2-135M weights, round-to-nearest quantized into each served layout, answer through the three
processes. SmolLM2's sizes exercise the edges: hidden 576 takes AWQ groups of 64 (not 128), and block FP8's
128-wide blocks leave partial edge blocks (576 = 4.5 blocks, and the fused qkv's q part is 576 rows)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import ServedCluster

QUANT_VERSION = 1  # bump when the quantizers in tests/worker/quant_checkpoints.py change: the dirs are cached
_ASSETS = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
           "special_tokens_map.json")


def _quantized_dir(embedded_model_dir: Path, fmt: str) -> Path:
    """Written once per machine next to the embedded model (quantizing costs tens of seconds on loaded cores) and
    renamed into place when finished, so a crash leaves no half-written directory."""
    import torch
    from safetensors.torch import load_file

    from tests.worker.quant_checkpoints import awq_config, fp8_config, write_quantized

    cached = embedded_model_dir.parent.parent / "test-models" / f"smollm2-{fmt}-v{QUANT_VERSION}"
    if (cached / "config.json").exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.parent / f".{cached.name}.{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(embedded_model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    config = json.loads((embedded_model_dir / "config.json").read_text())
    quant = awq_config(64) if fmt == "awq" else fp8_config((128, 128))
    write_quantized(state, config, partial, quant, torch.bfloat16)
    for name in _ASSETS:
        if (embedded_model_dir / name).exists():
            shutil.copy(embedded_model_dir / name, partial / name)
    try:
        partial.rename(cached)
    except OSError:  # another session won the race
        shutil.rmtree(partial, ignore_errors=True)
    return cached


@pytest.mark.parametrize("fmt", ["awq", "fp8"])
def test_quantized_smollm2_answers(fmt: str, tmp_path: Path, embedded_model_dir: Path) -> None:
    model_dir = _quantized_dir(embedded_model_dir, fmt)
    cluster = ServedCluster(tmp_path, model=str(model_dir), model_name=f"smol-{fmt}", max_model_len=512,
                            num_blocks=64, block_size=16).start(timeout=300)
    try:
        resp = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=180, json={
            "model": f"smol-{fmt}", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert resp.status_code == 200, resp.text
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]
    finally:
        cluster.stop()
