"""On the GPU: the ragged prefill kernels (attention included, and the decode pair that takes a mixed step's
one-token sequences) compile one variant for every batch of up to 64 sequences and any token count, and one per
power of two above, so an eager step (a hybrid model's mixed steps) meets no compile the start-up warm-up
(`assembly.warm_eager_prefill`) did not make. Counted in Triton's
per-device kernel cache."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda.kernels import attention_decode as D
from infer_backend_cuda.kernels import attention_prefill as A
from infer_backend_cuda.kernels import causal_conv1d as C
from infer_backend_cuda.kernels import gdn_chunk as G
from infer_backend_cuda.kernels import gdn_wy as WY
from tests.backend_cuda.conftest import gpu, needs_cuda

pytestmark = [gpu, needs_cuda]
BATCHES = [[1], [5, 3], [16] * 16, [7] * 17, [2] * 40, [70, 1, 1], [3] * 64]  # batch sizes 1..64, odd and even
WIDE = [[2] * 65, [2] * 100, [2] * 129]  # the next two buckets


def _variants(kernel) -> int:  # noqa: ANN001 - a triton JITFunction
    return len(kernel.device_caches[torch.cuda.current_device()][0])


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32, device="cuda")


def _conv(lens: list[int], channels: int = 256) -> None:
    t = sum(lens)
    x = torch.randn(t, channels, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(channels, 4, device="cuda", dtype=torch.bfloat16)
    states = torch.zeros(len(lens) + 1, channels, 3, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(1, len(lens) + 1, dtype=torch.int32, device="cuda")
    C.causal_conv1d(x, w, states, _cu(lens), slots, max(lens))


def _chunk(lens: list[int], hk: int = 2, hv: int = 4, d: int = 64) -> None:
    t = sum(lens)
    q, k = (torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(t, hv, d, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(t, hv, device="cuda")
    beta = torch.rand(t, hv, device="cuda")
    states = torch.zeros(len(lens) + 1, hv, d, d, device="cuda")
    slots = torch.arange(1, len(lens) + 1, dtype=torch.int32, device="cuda")
    G.gdn_chunk(q, k, v, g, beta, states, _cu(lens), slots)


def _attention(lens: list[int], hq: int = 8, hkv: int = 2, d: int = 128, bs: int = 16,
               merge_in_kernel: bool = True) -> None:
    """Each sequence's query after a prefix of 5 tokens, in a block table of one fixed width (as the engine's)."""
    t, pages = sum(lens), 16
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(len(lens) * pages + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(len(lens) * pages, dtype=torch.int32, device="cuda").view(len(lens), pages)
    seq_lens = torch.tensor([n + 5 for n in lens], dtype=torch.int32, device="cuda")
    # As a mixed step runs it (TritonFusedOps.paged_attention): one-token sequences on the decode kernels.
    out = A.paged_attention_prefill(q, kc, kc.clone(), _cu(lens), seq_lens, bt, max(lens), d**-0.5,
                                    skip_single_token=True)
    D.paged_attention_decode(q, kc, kc.clone(), seq_lens, bt, d**-0.5, out=out, query_start_loc=_cu(lens),
                             merge_in_kernel=merge_in_kernel)


# The conv has two token tiles (a step whose longest query fits the conv window, and the rest): twice the variants.
# The chunked rule's sequential pass has no batch-sized block (its grid is the batch): one variant for all.
@pytest.mark.parametrize("run,kernel,tiles,wide", [
    (_conv, C._causal_conv1d_kernel, 2, 2), (_chunk, WY._gdn_chunk_gram_kernel, 1, 2),
    (_chunk, WY._gdn_chunk_solve_kernel, 1, 2), (_chunk, G._gdn_chunk_state_kernel, 1, 0), (_attention, A._prefill_kernel, 1, 2)],
    ids=["causal_conv1d", "gdn_chunk_gram", "gdn_chunk_solve", "gdn_chunk_state", "attention_prefill"])
def test_prefill_batches_up_to_64_sequences_share_one_variant(run, kernel, tiles: int, wide: int) -> None:  # noqa: ANN001
    kernel.device_caches.clear()  # count from none (the variants reload from Triton's disk cache)
    for lens in BATCHES:
        run(lens)
    torch.cuda.synchronize()
    assert _variants(kernel) == tiles
    for lens in WIDE:
        run(lens)
    torch.cuda.synchronize()
    assert _variants(kernel) == tiles + wide  # WIDE's batches (2-token queries): 128 and 256 lanes


@pytest.mark.parametrize(("kernel", "merge_in_kernel"),
                         [(D._decode_split_kernel, True), (D._decode_reduce_kernel, False)], ids=["split", "reduce"])
def test_mixed_step_decode_kernels_compile_once_for_any_batch(kernel, merge_in_kernel: bool) -> None:  # noqa: ANN001
    """The decode pair in a mixed step: its split count follows the batch size (at Hkv 2 on an H200 from 32 at
    one sequence to 2 at 129) but is no compile-time constant, so every batch shares one variant. (The reduce pass
    runs only with the merge out of the split pass: by default its last program merges.)"""
    kernel.device_caches.clear()
    for lens in BATCHES + WIDE:
        _attention(lens, merge_in_kernel=merge_in_kernel)
    torch.cuda.synchronize()
    assert _variants(kernel) == 1
