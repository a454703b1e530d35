"""Reference sampler: temperature -> top-k -> top-p -> min-p, then a counter-based exponential race.

`argmax(probs / E)` with `E = -log(u)` i.i.d. Exp(1) picks token `v` with probability `probs[v]` (the
"exponential race", equivalent to Gumbel-max), and `u` comes from `counter_rng`, so the draw depends only on
(seed, position, vocab index). The CUDA backend implements the same formula, so both backends agree.
"""

from __future__ import annotations

import torch

from infer_core.ports.sampler import SampleOutput, SamplingBatch
from infer_backend_cpu.counter_rng import counter_uniform


def _chosen_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each chosen token under the unmodified distribution (no temperature, no filters)."""
    return torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None]).squeeze(1)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution the stochastic rows sample from `[N, V]` float32.

    Per row: scale by the temperature; find the cut position in descending order, `n_keep` = the smaller of
    top-k (0 = off) and top-p (1 = off; over the softmax of the top-k prefix, keep a position while the mass
    strictly before it is < p; the top token always stays); keep every token whose scaled logit is >= the
    value at position `n_keep - 1` (a threshold, so tokens tied with the cut value stay, exactly as the CUDA
    backend's kernel does); then min-p drops tokens whose probability is < `min_p * max probability`; and
    the survivors are renormalised. Greedy rows (temperature 0) are filtered at temperature 1 here; the
    caller overrides them with the argmax.
    """
    temperature = batch.temperature.to(torch.float32)
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / safe_temperature[:, None]
    vocab = scaled.shape[-1]

    sorted_logits = scaled.sort(dim=-1, descending=True).values
    rank = torch.arange(vocab, device=logits.device)[None, :]
    top_k = batch.top_k.to(torch.int64)
    k_limit = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    in_top_k = rank < k_limit[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~in_top_k, float("-inf")), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    top_p = batch.top_p.to(torch.float32)[:, None]
    # Rows with p >= 1 skip the test so that float rounding of the cumulative sum cannot trim the tail of a
    # filter that is off. Both kept sets are prefixes of the sorted order, so their intersection is one too.
    in_top_p = (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)
    num_kept = (in_top_k & in_top_p).sum(dim=-1, keepdim=True)
    threshold = sorted_logits.gather(1, num_kept - 1)
    filtered = scaled.masked_fill(scaled < threshold, float("-inf"))

    # min-p compares with the top probability; the ratio prob / max is unchanged by renormalisation, so the
    # truncated distribution gives the same cut as the full one would.
    probs = torch.softmax(filtered, dim=-1)
    min_p = batch.min_p.to(torch.float32)[:, None]
    filtered = filtered.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return torch.softmax(filtered, dim=-1)


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`argmax(probs / -log(u))` per row with counter-based `u`; computed in float64 like the noise."""
    u = counter_uniform(seeds, positions, probs.shape[-1])
    return torch.argmax(probs.to(torch.float64) / -torch.log(u), dim=-1)


class CpuSampler:
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        logits = logits.to(torch.float32)
        greedy = torch.argmax(logits, dim=-1)
        if batch.all_greedy:
            token_ids = greedy
        else:
            drawn = exponential_race(filtered_probs(logits, batch), batch.seeds, batch.positions)
            token_ids = torch.where(batch.temperature == 0, greedy, drawn)
        return SampleOutput(token_ids=token_ids, logprobs=_chosen_logprobs(logits, token_ids))
