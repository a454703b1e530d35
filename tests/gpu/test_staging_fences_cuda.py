"""On the GPU: with the device far behind the host (a prefill chunk samples nothing, so the worker loop does not
wait for it), every upload still delivers its own inputs. Without the staging fences the fourth upload rewrote the
first one's page-locked slot before the device had copied it (the 9,000-token crash of issue 13)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_uploads_arrive_intact_while_the_device_lags() -> None:
    from infer_backend_cuda import CudaBackend
    from infer_worker.application.input_upload import SLOTS, InputUploader

    backend = CudaBackend(device="cuda:0")
    uploader = InputUploader(backend, "cuda:0")
    sent = [np.full(4096, k, dtype=np.int64) for k in range(3 * SLOTS)]
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time: every copy below is queued behind it
    seen = []
    for array in sent:
        (dev,) = uploader.upload([array])
        seen.append(dev.clone())  # stream-ordered: runs after this upload's copy, before the next one's
    torch.cuda.synchronize()
    for k, (array, got) in enumerate(zip(sent, seen)):
        assert np.array_equal(got.cpu().numpy(), array), f"upload {k} arrived as {got[:4].tolist()}"
