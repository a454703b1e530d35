"""Suite-wide set-up. Without a GPU the CUDA adapter's kernels run in simulation: Triton's interpreter and
Numba's CUDA simulator must be switched on before either library is first imported, so it happens here."""

from __future__ import annotations

import os
import shutil


def _has_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    import torch

    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
