"""GPU sampler: greedy, temperature, top-k, top-p, min-p and seeded counter-based draws, with no host
synchronisation (no .item(), no .cpu(), no data-dependent shapes), so it runs inside a CUDA graph.

Per row, in this order (the semantics the CPU backend implements):
1. temperature == 0 -> greedy: arg-max of the raw logits (lowest index on ties).
2. `scaled = logits / temperature`.
3. top-k (0 = off): keep the k largest (ties at the k-th value kept).
4. top-p (>= 1 = off): over the softmax of the top-k survivors in descending order, keep the smallest
   prefix whose mass reaches p (a token is kept when the mass strictly before it is < p; the top token is
   always kept); ties at the cut are kept.
5. min-p (0 = off): drop tokens whose probability < min_p * max probability.
6. `token = argmax(probs / -log(u))` over the survivors, u the counter-based uniform of
   (seed, position, vocab index).
logprob = log_softmax(unmodified logits)[token].

Split of the work:
- `cut_thresholds`: one descending torch sort of the raw logits per row (temperature > 0 keeps the order),
  then a Triton kernel (`kernels/sampling.py`) turns the sorted row into the top-k / top-p cut as a
  raw-logit threshold (a value that occurs in the row, so the draw kernel's `x >= threshold` test is exact
  and always keeps the top token) and the row max. Skipped when the batch is all greedy.
- `numba_kernels.sample_partials` (Numba CUDA): one pass over the logits doing min-p, the draw, the greedy
  arg-max and the log-sum-exp, split in chunks; `merge_partials` (Triton) combines the chunks.

The sort is the dominant cost whenever a batch is not all greedy (measured on the H200 at V = 151936:
~0.7 ms for 64 rows, ~2.8 ms for 256); see docs/kernels.md.
"""

from __future__ import annotations

import torch

from infer_backend_cuda import numba_kernels
from infer_core.ports.sampler import SampleOutput, SamplingBatch


def cut_thresholds(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (raw-logit threshold of the top-k / top-p cut, row max), both float32 `[N]`. Rows with
    temperature 0 are computed at temperature 1 (the draw kernel ignores them)."""
    from infer_backend_cuda.kernels.sampling import topk_topp_threshold

    dev = logits.device
    sorted_vals = torch.sort(logits, dim=-1, descending=True).values
    return topk_topp_threshold(
        sorted_vals,
        batch.temperature.to(device=dev, dtype=torch.float32),
        batch.top_k.to(device=dev, dtype=torch.int32),
        batch.top_p.to(device=dev, dtype=torch.float32),
    )


class CudaSampler:
    """The `Sampler` port on the GPU (torch thresholds + the Numba one-pass draw kernel)."""

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)

    def warmup(self) -> None:
        """Compile and load the Numba kernels; call before any CUDA-graph capture."""
        numba_kernels.warmup(self.device)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        logits = logits.float()
        n_rows = logits.shape[0]
        if batch.all_greedy:
            zeros = torch.zeros((n_rows,), dtype=torch.float32, device=logits.device)
            threshold = row_max = zeros
        else:
            threshold, row_max = cut_thresholds(logits, batch)
        parts = numba_kernels.sample_partials(
            logits,
            batch.temperature,
            threshold,
            row_max,
            batch.min_p,
            batch.seeds,
            batch.positions,
            batch.all_greedy,
        )
        token_ids, logprobs = numba_kernels.merge_partials(logits, *parts)
        return SampleOutput(token_ids=token_ids, logprobs=logprobs)
