"""Tiny tensors run fastest on one thread, and a 2-core machine shared with other processes makes OpenMP's
barriers wait for descheduled threads (tiny GEMMs then take milliseconds). A conftest that imports
`single_torch_thread` pins torch to one thread per module of its folder and restores it afterwards."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
