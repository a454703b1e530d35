"""`model = "owner/name"`: the three real processes serve the embedded model's converted directory from a
Hugging Face cache under a repo id, offline (HF_HUB_OFFLINE=1), named by that repo id. The snapshot's
generation_config.json says temperature 0, which requests that leave temperature out then get from the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import ServedCluster
from tests.worker.hub_cache import add_snapshot, offline_env

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "5e6f" * 10
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a story about a dragon and a baker."}]


@pytest.fixture(scope="module")
def hub_cluster(tmp_path_factory: pytest.TempPathFactory,
                embedded_model_dir: Path) -> Iterator[tuple[ServedCluster, Path]]:
    """The cluster and the snapshot directory it serves."""
    hf_home = tmp_path_factory.mktemp("hf-home")
    files: dict[str, bytes | Path] = {p.name: p for p in embedded_model_dir.iterdir() if not p.name.startswith(".")}
    generation_config = json.loads((embedded_model_dir / "generation_config.json").read_text())
    files["generation_config.json"] = json.dumps(generation_config | {"temperature": 0.0}).encode()
    snapshot = add_snapshot(hf_home, REPO_ID, COMMIT, files)
    cluster = ServedCluster(tmp_path_factory.mktemp("hub-cluster"), model=REPO_ID, max_model_len=1024,
                            max_batch_seqs=8, log_level="info")
    with pytest.MonkeyPatch.context() as env:  # the launcher hands its environment to the three processes
        for name, value in offline_env(hf_home).items():
            env.setenv(name, value)
        cluster.start()
    yield cluster, snapshot
    cluster.stop()


def _chat(cluster: ServedCluster, messages: list[dict[str, str]], **fields: Any) -> str:
    r = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": 16} | fields)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_a_hub_id_is_served_offline_from_the_cache_under_the_repo_id(
        hub_cluster: tuple[ServedCluster, Path]) -> None:
    cluster, snapshot = hub_cluster
    [card] = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["root"]) == (REPO_ID, str(snapshot))  # the worker loaded the cache's snapshot
    assert _chat(cluster, QUESTION, model=REPO_ID, temperature=0) == "The capital of France is Paris."


def test_the_model_temperature_is_the_default_and_a_request_temperature_wins(
        hub_cluster: tuple[ServedCluster, Path]) -> None:
    cluster, _ = hub_cluster
    assert "generation defaults from generation_config.json: temperature=0.0" in cluster.log_path.read_text()
    greedy = _chat(cluster, STORY, temperature=0, seed=1)
    # without temperature the model's 0 applies: greedy, so every seed gives the greedy text
    assert [_chat(cluster, STORY, seed=seed) for seed in (1, 2)] == [greedy] * 2
    # the request's own temperature 1 wins: seeded samples of 16 tokens leave the greedy path
    sampled = [_chat(cluster, STORY, temperature=1.0, seed=seed) for seed in (1, 2, 3)]
    assert any(text != greedy for text in sampled), sampled
