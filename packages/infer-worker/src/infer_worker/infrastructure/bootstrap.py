"""Starts a worker: the I/O half (model directory, config.json, the backend from the entry point group, the
weights, the fault-injection environment), then the application's assembly (`application/assembly.py`: KV sizing,
runner, self-check). Under tensor parallelism every rank runs this, in lockstep from the loaded weights on."""

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
from infer_worker.infrastructure.backend_registry import create_backend, resolve_backend_class
from infer_worker.infrastructure.embedded_model import ensure_embedded_model
from infer_worker.infrastructure.grammar_tokenizer import tokenizer_info_factory
from infer_worker.infrastructure.model_loader import load_model, read_spec
from infer_worker.infrastructure.model_source import ModelSourceError, resolve_model_source
from infer_worker.infrastructure.rank_group import RankGroup, rank_device
from infer_worker.models.tensor_parallel import check_tensor_parallel

__all__ = ["Progress", "ReadyWorker", "StartupError", "bootstrap", "resolve_model_dir"]


def resolve_model_dir(config: Config) -> Path:
    if not config.model:
        return ensure_embedded_model()
    try:
        return resolve_model_source(config.model, config.revision)
    except ModelSourceError as exc:
        raise StartupError(str(exc)) from None


def bootstrap(config: Config, progress: Progress, group: RankGroup | None = None) -> ReadyWorker:
    """`group`: this process's rank when `tensor_parallel_size > 1` (the ranks join it once the model passed)."""
    progress("resolving the model directory")
    model_dir = resolve_model_dir(config)
    try:  # config.json alone: an unservable checkpoint is refused before the backend starts or a weight is read
        spec = read_spec(model_dir)
        check_tensor_parallel(spec, config.tensor_parallel_size)
        max_model_len = context_limit(config, spec)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    device, agree_blocks = config.device, None
    if group is not None:
        progress(f"starting {group.world} tensor-parallel ranks")
        if not group.start():
            raise StartupError("rank 0 stopped before the rank group started")
        device = rank_device(config.device, resolve_backend_class(config.backend)[0], group.rank)
        agree_blocks = group.min_int
    backend = create_backend(config.backend, device, config.dtype)
    if group is not None:
        backend.join_tensor_parallel(config.tp_operation_timeout_secs)
    dtype = backend.default_dtype()
    progress(f"loading weights from {model_dir} on {backend.name}:{backend.device} ({dtype.value})")
    model, _ = load_model(model_dir, backend, dtype, config.load_format, config.seed)
    if group is not None:
        group.barrier()
    return assemble(config, backend, model, model_dir, max_model_len, progress,
                    fault=os.environ.get(FAULT_ENV), fault_kind=os.environ.get(FAULT_KIND_ENV),
                    tokenizer_info=tokenizer_info_factory(model_dir), agree_blocks=agree_blocks)
