"""Continuous batching, paged KV block allocator, RadixTree prefix cache, chunked prefill, preemption.

Public API: `Engine` (pure logic: submit / abort / plan_step / apply_result / stats), `Service` (the ZMQ process
loop around it, in `infer_scheduler.service`), and the parts it is built from.
"""

from infer_scheduler.block_allocator import BlockAllocator, BlockError
from infer_scheduler.engine import Engine, EngineError
from infer_scheduler.kv_manager import KvCacheManager
from infer_scheduler.planner import Planner, Schedule
from infer_scheduler.policy import FcfsPolicy
from infer_scheduler.radix_cache import RadixCache, RadixNode
from infer_scheduler.request import Request, RequestStatus

__all__ = [
    "BlockAllocator", "BlockError", "Engine", "EngineError", "FcfsPolicy", "KvCacheManager", "Planner",
    "RadixCache", "RadixNode", "Request", "RequestStatus", "Schedule",
]
