"""NCCL collectives over torch.distributed for the ranks of one node, one GPU each.

torch.distributed's NCCL collectives are capturable in CUDA graphs once the communicator exists: the group is
created eagerly on this rank's device and warmed up with one all-reduce before any capture, and every rank
captures (and replays) the same collectives in the same order because the ranks run the same steps in lockstep.
NVLink multicast stays off in NCCL (NVLS, and CollNet), PyTorch's symmetric memory and NVSHMEM: a program that
uses it can put a host's shared GPUs out of service, and ring/tree all-reduce serves these message sizes."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                  "NVSHMEM_DISABLE_NVLS": "1"}


class NcclCollective:
    def __init__(self, device: torch.device, timeout_s: float) -> None:
        os.environ.update(_MULTICAST_OFF)  # read when the communicator is created, just below
        self._group = dist.new_group(backend="nccl", timeout=timedelta(seconds=timeout_s), device_id=device)
        self.world_size: int = dist.get_world_size(self._group)
        self.rank: int = dist.get_rank(self._group)
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm, group=self._group)
        torch.cuda.synchronize(device)
        if int(warm.item()) != self.world_size:
            raise RuntimeError(f"NCCL warm-up all-reduce gave {warm.item()}, expected {self.world_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self._group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self._group)
        return torch.cat(out.unbind(0), dim=dim)
