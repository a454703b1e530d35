"""msgpack codecs for each direction of each channel (reusable encoder/decoders, no per-message set-up)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from infer_protocol.messages import SchedulerToServer, SchedulerToWorker, ServerToScheduler, WorkerToScheduler

T = TypeVar("T")


class Codec(Generic[T]):
    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def encode(self, msg: Any) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> T:
        return self._decoder.decode(data)


def server_to_scheduler() -> Codec[ServerToScheduler]:
    return Codec(ServerToScheduler)


def scheduler_to_server() -> Codec[SchedulerToServer]:
    return Codec(SchedulerToServer)


def scheduler_to_worker() -> Codec[SchedulerToWorker]:
    return Codec(SchedulerToWorker)


def worker_to_scheduler() -> Codec[WorkerToScheduler]:
    return Codec(WorkerToScheduler)
