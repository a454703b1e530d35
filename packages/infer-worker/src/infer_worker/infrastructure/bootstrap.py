"""Starts a worker: the I/O half (model directory, config.json, the backend from the entry point group, the
weights, the fault-injection environment), then the application's assembly (`application/assembly.py`: KV sizing,
runner, self-check)."""

from __future__ import annotations

import os
from pathlib import Path

from infer_protocol.config import Config

from infer_worker.application.assembly import (
    Progress,
    ReadyWorker,
    StartupError,
    assemble,
    context_limit,
)
from infer_worker.application.fault_injection import FAULT_ENV, FAULT_KIND_ENV
from infer_worker.infrastructure.backend_registry import create_backend
from infer_worker.infrastructure.embedded_model import ensure_embedded_model
from infer_worker.infrastructure.grammar_tokenizer import tokenizer_info_factory
from infer_worker.infrastructure.model_loader import load_model, read_spec
from infer_worker.infrastructure.model_source import ModelSourceError, resolve_model_source

__all__ = ["Progress", "ReadyWorker", "StartupError", "bootstrap", "resolve_model_dir"]


def resolve_model_dir(config: Config) -> Path:
    if not config.model:
        return ensure_embedded_model()
    try:
        return resolve_model_source(config.model, config.revision)
    except ModelSourceError as exc:
        raise StartupError(str(exc)) from None


def bootstrap(config: Config, progress: Progress) -> ReadyWorker:
    progress("resolving the model directory")
    model_dir = resolve_model_dir(config)
    try:  # config.json alone: an unservable checkpoint is refused before the backend starts or a weight is read
        max_model_len = context_limit(config, read_spec(model_dir))
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    backend = create_backend(config.backend, config.device, config.dtype)
    dtype = backend.default_dtype()
    progress(f"loading weights from {model_dir} on {backend.name}:{backend.device} ({dtype.value})")
    model, _ = load_model(model_dir, backend, dtype, config.load_format, config.seed)
    return assemble(config, backend, model, model_dir, max_model_len, progress,
                    fault=os.environ.get(FAULT_ENV), fault_kind=os.environ.get(FAULT_KIND_ENV),
                    tokenizer_info=tokenizer_info_factory(model_dir))
