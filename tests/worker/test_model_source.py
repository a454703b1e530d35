"""The `model` value as a local directory or a Hugging Face Hub id, resolved offline from a prepared cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir

from infer_protocol.config import hub_repo_id
from tests.worker.hub_cache import add_snapshot, offline_env, resolve_offline

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b1" * 20


def _files(version: str) -> dict[str, bytes | Path]:
    return {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "version": version}).encode(),
        "tokenizer.json": b"{}",
        "model.safetensors": version.encode(),
    }


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(tmp_path: Path) -> None:
    snapshot = add_snapshot(tmp_path, "acme/tiny-chat", COMMIT_MAIN, _files("main"))
    [repo] = scan_cache_dir(tmp_path / "hub").repos  # huggingface_hub itself reads the layout as a cached repo
    assert (repo.repo_id, [rev.commit_hash for rev in repo.revisions]) == ("acme/tiny-chat", [COMMIT_MAIN])
    found = resolve_offline(tmp_path, "acme/tiny-chat")
    assert found == {"dir": str(snapshot)}
    assert json.loads((Path(found["dir"]) / "config.json").read_text())["version"] == "main"
    assert (Path(found["dir"]) / "model.safetensors").read_bytes() == b"main"


def test_a_repo_missing_from_the_cache_is_one_line_naming_the_id_and_the_cache(tmp_path: Path) -> None:
    add_snapshot(tmp_path, "acme/tiny-chat", COMMIT_MAIN, _files("main"))
    error = resolve_offline(tmp_path, "acme/missing")["error"]
    assert "acme/missing" in error and str(tmp_path / "hub") in error and "HF_HUB_OFFLINE" in error, error
    assert "\n" not in error
    error = resolve_offline(tmp_path, "acme/tiny-chat", "v9")["error"]  # the repo is there, that revision is not
    assert "acme/tiny-chat at revision v9" in error and str(tmp_path / "hub") in error, error


@pytest.mark.parametrize("missing", ["model.safetensors", "tokenizer.json"])
def test_a_snapshot_with_files_missing_is_named_as_partly_cached(tmp_path: Path, missing: str) -> None:
    """An interrupted download: the tree listing huggingface_hub kept names a file the snapshot lacks (a weight
    file, or one of the metadata files fetched first)."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")  # newer huggingface_hub releases only
    files = {name: content for name, content in _files("main").items() if name != missing}
    snapshot = add_snapshot(tmp_path, "acme/tiny-chat", COMMIT_MAIN, files)
    listing = {name: tree_cache.TreeCacheEntry(size=2, blob_id=name) for name in _files("main")}
    tree_cache.write_tree_cache(str(snapshot.parent.parent), COMMIT_MAIN, listing)
    error = resolve_offline(tmp_path, "acme/tiny-chat")["error"]
    assert "acme/tiny-chat is only partly in the Hugging Face cache" in error, error


def test_with_an_index_only_the_shards_it_names_are_wanted(tmp_path: Path) -> None:
    """The repo also holds a consolidated copy of the weights, never downloaded: huggingface_hub's completeness
    check (against the tree listing it kept) finds nothing missing, since only the index's shards are asked for."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = {"metadata": {}, "weight_map": {"a.weight": shards[0], "b.weight": shards[1], "c.weight": shards[1]}}
    files: dict[str, bytes | Path] = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode()}
    files |= {shard: shard.encode() for shard in shards}
    snapshot = add_snapshot(tmp_path, "acme/sharded", COMMIT_MAIN, files)
    listing = {name: tree_cache.TreeCacheEntry(size=2, blob_id=name) for name in [*files, "consolidated.safetensors"]}
    tree_cache.write_tree_cache(str(snapshot.parent.parent), COMMIT_MAIN, listing)
    assert resolve_offline(tmp_path, "acme/sharded") == {"dir": str(snapshot)}


def test_a_pinned_revision_resolves_to_that_snapshot(tmp_path: Path) -> None:
    main = add_snapshot(tmp_path, "acme/tiny-chat", COMMIT_MAIN, _files("main"))
    v1 = add_snapshot(tmp_path, "acme/tiny-chat", COMMIT_V1, _files("v1"), refs=("v1",))
    assert resolve_offline(tmp_path, "acme/tiny-chat") == {"dir": str(main)}  # "" = main
    assert resolve_offline(tmp_path, "acme/tiny-chat", "main") == {"dir": str(main)}
    assert resolve_offline(tmp_path, "acme/tiny-chat", "v1") == {"dir": str(v1)}  # a tag
    assert resolve_offline(tmp_path, "acme/tiny-chat", COMMIT_V1) == {"dir": str(v1)}  # a commit
    assert json.loads((v1 / "config.json").read_text())["version"] == "v1"


def test_a_local_directory_still_works_and_wins_over_a_hub_id_spelled_alike(tmp_path: Path) -> None:
    add_snapshot(tmp_path, "acme/tiny-chat", COMMIT_MAIN, _files("main"))
    local = tmp_path / "work" / "acme" / "tiny-chat"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert resolve_offline(tmp_path, str(local)) == {"dir": str(local)}
    assert resolve_offline(tmp_path, "acme/tiny-chat", cwd=tmp_path / "work") == {"dir": "acme/tiny-chat"}
    assert resolve_offline(tmp_path, str(local.parent))["error"].startswith("model directory ")  # no config.json


def test_hub_id_shape() -> None:
    assert hub_repo_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert hub_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for not_an_id in ("", "gpt2", "/models/x", "./x", "~/x", "a/b/c", "a/", "/a"):
        assert hub_repo_id(not_an_id) is None, not_an_id


_WORKER_RESOLVE = """
from infer_protocol.config import Config
from infer_worker.infrastructure.bootstrap import StartupError, resolve_model_dir
try:
    resolve_model_dir(Config(model="acme/missing"))
except StartupError as exc:
    print(exc)
"""


def test_the_worker_refuses_a_hub_id_missing_offline_with_a_startup_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _WORKER_RESOLVE], env=offline_env(tmp_path), capture_output=True,
                         text=True, timeout=120, check=True)
    assert "acme/missing" in out.stdout and str(tmp_path / "hub") in out.stdout, out
