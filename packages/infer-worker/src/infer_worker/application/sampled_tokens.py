"""What a launched step hands back once its ids are on the host.

Application, not domain: the prompt logprobs are already the protocol's `PromptLogprobs`, which go into the
`StepResult` as they are (no conversion on the step's path).
"""

from __future__ import annotations

from typing import NamedTuple

from infer_protocol.messages import PromptLogprobs


class SampledTokens(NamedTuple):
    """The step's sampled tokens, in the order of the sampling sequences of the step."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    # per row, the (token id, logprob) alternatives it asked for ([] if none); None when no row asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # the prompt tokens the step computed for sequences that asked for their logprobs (any sequence of the step)
    prompt_logprobs: list[PromptLogprobs] = []
