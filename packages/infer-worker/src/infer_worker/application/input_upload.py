"""A step's host arrays to the device in one asynchronous copy.

The arrays are packed into a page-locked staging buffer and copied with one non-blocking transfer into a device
buffer, whose typed views are the step's input tensors. The host never waits for the steps queued before (a
copy from pageable memory would), so the next step's inputs are prepared while the current step runs. Staging
buffers rotate, and a buffer is written again only once its last copy has run (`CopyFences`): the device may be
several steps behind, since a step that samples nothing (a prefill chunk) is not waited for by the worker loop.
Without the fence, a long prompt's fourth chunk overwrote the first chunk's inputs before they were copied (a
9,000-token prompt in 2,048-token chunks on the H200: out-of-range gathers, a device-side assert).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from infer_core.ports.backend import HostTransfer, LlmBackend

SLOTS = 3
_ALIGN = 64  # bytes: every array starts at an offset any dtype view accepts
_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


def device_views(region: torch.Tensor, layout: Sequence[tuple[int, np.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Typed views of a uint8 buffer at (offset, dtype, shape)."""
    return [region[off:off + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(_TORCH[dtype]).view(shape)
            for off, dtype, shape in layout]


def host_views(buf: torch.Tensor, layout: Sequence[tuple[int, np.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
    """Typed numpy views of a uint8 host buffer at (offset, dtype, shape): the staging side of `device_views`."""
    raw = buf.numpy()
    return [raw[off:off + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)
            for off, dtype, shape in layout]


class CopyFences:
    """One marker per staging slot at the stream position after the slot's last copy: a slot is written again
    only when the device has read it. The marker is an empty device-to-host transfer (its event), so the wait
    costs nothing when the device keeps up, which is the common case."""

    def __init__(self, backend: LlmBackend) -> None:
        self._backend = backend
        self._after_copy: list[HostTransfer | None] = [None] * SLOTS

    def wait(self, slot: int) -> None:
        fence = self._after_copy[slot]
        if fence is not None:
            fence.wait()
            self._after_copy[slot] = None

    def copied(self, slot: int) -> None:
        """Call right after enqueuing the slot's copy."""
        self._after_copy[slot] = self._backend.copy_to_host([])


class StagingRing:
    """`SLOTS` page-locked host buffers used in turn (grown when an upload needs more); `take` returns a slot the
    device has finished reading, and `copied` marks the copy just enqueued from it."""

    def __init__(self, backend: LlmBackend, num_bytes: int = 1 << 16) -> None:
        self._backend = backend
        self._buffers: list[torch.Tensor] = [backend.staging_buffer(num_bytes) for _ in range(SLOTS)]
        self._fences = CopyFences(backend)
        self._next = 0
        self._taken = 0

    def take(self, num_bytes: int) -> torch.Tensor:
        i = self._next
        self._next = (i + 1) % SLOTS
        self._fences.wait(i)
        if self._buffers[i].numel() < num_bytes:
            self._buffers[i] = self._backend.staging_buffer(2 * num_bytes)
        self._taken = i
        return self._buffers[i]

    def copied(self) -> None:
        self._fences.copied(self._taken)


class InputUploader:
    """Uploads a list of numpy arrays (int64 / int32 / float32) as one copy; returns device tensors in order."""

    def __init__(self, backend: LlmBackend, device: str) -> None:
        self._ring = StagingRing(backend)
        self._device = device
        self._region: torch.Tensor | None = None

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        layout, total = [], 0
        for array in arrays:
            layout.append((total, array.dtype, array.shape))
            total += aligned(array.nbytes)
        staging = self._ring.take(total)
        host = staging.numpy()
        for (off, _, _), array in zip(layout, arrays):
            host[off:off + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if self._region is None or self._region.numel() < total:
            # The old region may still feed the step in flight: freed memory is reused only by later work
            # on the same stream, which runs after it.
            self._region = torch.empty(max(2 * total, 1 << 16), dtype=torch.uint8, device=self._device)
        self._region[:total].copy_(staging[:total], non_blocking=True)
        self._ring.copied()
        return device_views(self._region, layout)
