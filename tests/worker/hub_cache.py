"""A Hugging Face Hub cache written by hand, as huggingface_hub lays it out (there is no network here to let it
download one): `<HF_HOME>/hub/models--owner--name/{blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>,
refs/<branch or tag> = <commit>}`. The resolution itself runs in a fresh interpreter with HF_HOME and
HF_HUB_OFFLINE set, since huggingface_hub reads both once, when it is first imported."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub.file_download import repo_folder_name


def add_snapshot(hf_home: Path, repo_id: str, commit: str, files: Mapping[str, bytes | Path],
                 refs: Sequence[str] = ("main",)) -> Path:
    """One commit of `repo_id` in the cache under `hf_home`, named by `refs`; its snapshot directory. A file given
    as a Path becomes a blob linking to it (a model's weights are not copied)."""
    assert len(commit) == 40, "a commit is 40 hex digits"
    storage = hf_home / "hub" / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, Path):
            blob = storage / "blobs" / hashlib.sha256(str(content.resolve()).encode()).hexdigest()
            if not blob.is_symlink():
                blob.symlink_to(content.resolve())
        else:
            blob = storage / "blobs" / hashlib.sha256(content).hexdigest()
            blob.write_bytes(content)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    """This environment with huggingface_hub pointed at `hf_home`, offline (no other HF_ setting leaks in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RUSTINFER_"))}
    return env | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


_RESOLVE = """
import json, sys
from infer_worker.infrastructure.model_source import ModelSourceError, resolve_model_source
try:
    print(json.dumps({"dir": str(resolve_model_source(sys.argv[1], sys.argv[2]))}))
except ModelSourceError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def resolve_offline(hf_home: Path, model: str, revision: str = "", cwd: Path | None = None) -> dict[str, Any]:
    """`resolve_model_source(model, revision)` in a fresh interpreter: {"dir": ...} or {"error": ...}."""
    out = subprocess.run([sys.executable, "-c", _RESOLVE, model, revision], env=offline_env(hf_home), cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))
