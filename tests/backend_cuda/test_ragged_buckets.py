"""The CUDA backend names the batch sizes at which the ragged kernels compile a new variant (the worker's start-up
warm-up runs a step of each: assembly.warm_eager_prefill)."""

from __future__ import annotations

from infer_backend_cuda.kernels._ragged import ragged_block_b, ragged_variant_batch_sizes


def test_the_cuda_backend_names_each_ragged_bucket_edge_below_the_batch_limit() -> None:
    assert ragged_variant_batch_sizes(256) == [65, 129] and ragged_variant_batch_sizes(257) == [65, 129, 257]
    assert ragged_variant_batch_sizes(64) == [] and ragged_variant_batch_sizes(65) == [65]
    for n in range(1, 600):  # each size is the first of its variant
        assert (n in ragged_variant_batch_sizes(600)) == (n > 1 and ragged_block_b(n) != ragged_block_b(n - 1))
