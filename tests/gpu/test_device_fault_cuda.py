"""On the GPU, through `rustinfer serve`: a real device-side assert in one step (the test-only fault injection's
device kind: an out-of-bounds gather) ends the worker at once instead of wedging it; the request in that step
gets an error, the launcher starts a new worker, and the cluster then serves a correct greedy answer again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.gpu

FAULT_TOKEN = 77
VOCAB = 256


def _tiny_model(path: Path) -> Path:
    """A tiny random Llama with a word-level tokenizer ("t0" .. "t255"): the embedded model is not on the GPU host."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.worker.tiny_checkpoints import llama_config, write_checkpoint

    write_checkpoint(llama_config(vocab_size=VOCAB), path, seed=4)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1", "unk_token": "t0"}))
    return path


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_a_device_side_assert_ends_the_worker_and_serve_recovers(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.e2e.cluster import ServedCluster
    from tests.e2e.test_faults import wait_for
    from tests.e2e.test_supervisor import _ready

    monkeypatch.setenv("INFER_WORKER_FAULT_ON_TOKEN", str(FAULT_TOKEN))
    monkeypatch.setenv("INFER_WORKER_FAULT_KIND", "device")
    model = _tiny_model(tmp_path / "tiny")
    cluster = ServedCluster(tmp_path, model=str(model), model_name="tiny", backend="cuda", max_model_len=256,
                            num_blocks=256, block_size=16, capture_sizes=[1, 2], capture_tokens=[64],
                            worker_max_restarts=2, log_level="info")
    cluster.start(timeout=300)
    try:
        clean = [5, 6, 7, 8, 9, 10]
        before = _complete(cluster.url, clean)
        assert before.status_code == 200, before.text
        start = time.monotonic()
        faulty = _complete(cluster.url, [5, 6, FAULT_TOKEN, 8])
        assert faulty.status_code >= 500 and faulty.json()["error"]["code"] in ("worker_lost", "step_failed"), (
            faulty.text)
        assert time.monotonic() - start < 30, "the faulty request hung"
        # the launcher restarts the worker; /ready turns 200 again
        wait_for("/ready 200 again", lambda: _ready(cluster.url) == 200, 300, 0.5)
        after = _complete(cluster.url, clean)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        assert "rustinfer_worker_restarts_total 1.0" in metrics
        log = cluster.log()
        assert "device-side assert" in log or "CUDA error" in log, log[-3000:]
    finally:
        cluster.stop()
