"""`model = "owner/name"`: the three real processes serve the embedded model's converted directory from a
Hugging Face cache under a repo id, offline (HF_HUB_OFFLINE=1), named by that repo id."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import ServedCluster
from tests.worker.hub_cache import add_snapshot, offline_env

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "5e6f" * 10
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hub_cluster(tmp_path_factory: pytest.TempPathFactory,
                embedded_model_dir: Path) -> Iterator[tuple[ServedCluster, Path]]:
    """The cluster and the snapshot directory it serves."""
    hf_home = tmp_path_factory.mktemp("hf-home")
    files = {p.name: p for p in embedded_model_dir.iterdir() if not p.name.startswith(".")}
    snapshot = add_snapshot(hf_home, REPO_ID, COMMIT, files)
    cluster = ServedCluster(tmp_path_factory.mktemp("hub-cluster"), model=REPO_ID, max_model_len=1024,
                            max_batch_seqs=8)
    with pytest.MonkeyPatch.context() as env:  # the launcher hands its environment to the three processes
        for name, value in offline_env(hf_home).items():
            env.setenv(name, value)
        cluster.start()
    yield cluster, snapshot
    cluster.stop()


def test_a_hub_id_is_served_offline_from_the_cache_under_the_repo_id(
        hub_cluster: tuple[ServedCluster, Path]) -> None:
    cluster, snapshot = hub_cluster
    [card] = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["root"]) == (REPO_ID, str(snapshot))  # the worker loaded the cache's snapshot
    r = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120, json={
        "model": REPO_ID, "messages": QUESTION, "temperature": 0, "max_tokens": 16})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
