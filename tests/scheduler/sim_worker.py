"""A simulated worker that drives the engine exactly like the real one, and checks what it is told.

It keeps the persistent batch of sequences keyed by seq_id and a fake paged KV cache: the slot of position p
holds a hash of the token prefix `token_ids[:p + 1]` (what real KV depends on). Every step it checks the plan's
diff semantics (forget first, NewSeq / ContinueSeq shapes, page-aligned num_computed, block coverage) and that
every position a sequence attends to still holds its own prefix hash — so a block freed while in use, a wrong
prefix-cache hit or a block shared by two different prefixes is caught. An image's placeholder positions hash their
image's content too (as real KV depends on the image), so KV shared across different images is caught as well. Sampling is a deterministic "greedy
model" of the prefix (the same tokens whatever the batching, caching or preemption), or random with `rng`.
With `num_state_slots` (a hybrid model) it also checks that every sequence it holds owns a state slot no other
live sequence has, and starts from position 0 (a state is never resumed from a cached prefix).

Grammars (`sampling.structured`): each compiles for `grammar_steps` steps from the sequence's first admission (a
recompute after preemption finds it compiled, as the real worker's cache does), then is reported ready in the next
result (`StepResult.grammars_ready`) or by `idle_status` (the worker's `GrammarStatus` when no step runs, which
also finishes every compilation: time passes while the worker idles); a grammar whose schema is `BAD_GRAMMAR` is
reported failed instead. The worker checks that no constrained sequence samples before it reported its grammar
ready (one whose prompt is a single token excepted: the scheduler cannot hold it).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from infer_protocol.messages import GrammarStatus, ImageInput, SeqError, StepPlan, StepResult

BAD_GRAMMAR = "(("  # a grammar the simulated worker fails to compile (invalid_grammar)


def extend_hashes(hashes: list[int], tokens: list[int] | list[object]) -> None:
    h = hashes[-1] if hashes else 0
    for t in tokens[len(hashes):]:
        h = hash((h, t))
        hashes.append(h)


def with_images(tokens: list[int], images: list[ImageInput]) -> list[object]:
    """The tokens as the KV sees them: each image placeholder is the token and its image's content."""
    out: list[object] = list(tokens)
    for image in images:
        for p in range(image.offset, image.offset + image.num_tokens):
            out[p] = (tokens[p], image.content_hash)
    return out


@dataclass
class SimSeq:
    seq_id: int
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    hashes: list[int] = field(default_factory=list)
    state_slot: int = 0
    grammar: str | None = None  # the schema of its sampling.structured
    prompt_len: int = 0


class SimWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000, rng: random.Random | None = None,
                 stop_token: int | None = None, stop_every: int = 0, num_state_slots: int = 0,
                 grammar_steps: int = 0) -> None:
        self.num_state_slots = num_state_slots
        self.grammar_steps = grammar_steps
        self.compiling: dict[int, int] = {}  # seq id -> steps its grammar still needs
        self.unreported: set[int] = set()  # held sequences whose grammar's outcome is not reported yet (this admission)
        self.ready: set[int] = set()  # sequences whose grammar was reported ready
        self.grammar_errors: list[SeqError] = []
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.rng = rng
        self.stop_token = stop_token
        self.stop_every = stop_every  # with stop_token: the model emits it when hash % stop_every == 0
        self.kv: dict[tuple[int, int], int] = {}
        self.seqs: dict[int, SimSeq] = {}
        self.last_step = 0
        self.tokens_computed = 0
        self.plans: list[StepPlan] = []

    def model(self, prefix_hash: int) -> int:
        if self.stop_token is not None and self.stop_every and prefix_hash % self.stop_every == 0:
            return self.stop_token
        if self.rng is not None:
            return self.rng.randrange(1, self.vocab_size)
        return 1 + (prefix_hash * 2654435761) % (self.vocab_size - 1)

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        bs = self.block_size
        assert plan.step == self.last_step + 1, (plan.step, self.last_step)
        self.last_step = plan.step
        for sid in list(plan.finished) + list(plan.preempted):
            assert sid in self.seqs, f"forget of unknown seq {sid}"
            del self.seqs[sid]
        work: list[tuple[SimSeq, int]] = []
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.seqs, f"NewSeq {ns.seq_id} already held"
            assert ns.num_computed % bs == 0 and 0 <= ns.num_computed < len(ns.token_ids), ns
            assert ns.num_tokens > 0 and ns.num_computed + ns.num_tokens <= len(ns.token_ids), ns
            if self.num_state_slots:
                assert 1 <= ns.state_slot <= self.num_state_slots and ns.num_computed == 0, ns
                owners = [s.seq_id for s in self.seqs.values() if s.state_slot == ns.state_slot]
                assert not owners, f"state slot {ns.state_slot} of seq {ns.seq_id} is still held by {owners}"
            else:
                assert ns.state_slot == 0, ns
            seq = SimSeq(ns.seq_id, list(ns.token_ids), ns.num_computed, list(ns.block_ids), state_slot=ns.state_slot,
                         prompt_len=len(ns.token_ids) - ns.num_generated)
            extend_hashes(seq.hashes, with_images(seq.token_ids, ns.images))
            self.seqs[ns.seq_id] = seq
            if ns.sampling.structured is not None:
                seq.grammar = ns.sampling.structured.schema
                self.compiling.setdefault(ns.seq_id, self.grammar_steps)  # (a recompute: compiled already)
                self.unreported.add(ns.seq_id)
            work.append((seq, ns.num_tokens))
        for c in plan.continuing:
            seq = self.seqs[c.seq_id]
            seq.block_ids.extend(c.new_block_ids)
            assert c.num_tokens > 0 and seq.num_computed + c.num_tokens <= len(seq.token_ids), (c, seq.num_computed)
            work.append((seq, c.num_tokens))
        ids = [s.seq_id for s, _ in work]
        assert len(set(ids)) == len(ids), "a sequence is scheduled twice"
        held = [b for s in self.seqs.values() for b in s.block_ids]
        assert all(0 <= b < self.num_blocks for b in held), held
        written: dict[tuple[int, int], int] = {}
        for seq, n in work:
            assert len(set(seq.block_ids)) == len(seq.block_ids), f"seq {seq.seq_id} holds a block twice"
            end = seq.num_computed + n
            assert len(seq.block_ids) * bs >= end, f"seq {seq.seq_id}: {len(seq.block_ids)} blocks for {end} tokens"
            for p in range(seq.num_computed):  # what it attends to must be its own prefix
                assert self.kv.get((seq.block_ids[p // bs], p % bs)) == seq.hashes[p], \
                    f"seq {seq.seq_id}: KV of position {p} is not its prefix"
            for p in range(seq.num_computed, end):
                slot = (seq.block_ids[p // bs], p % bs)
                assert written.get(slot, seq.hashes[p]) == seq.hashes[p], f"two prefixes write slot {slot}"
                written[slot] = seq.hashes[p]
        self.kv.update(written)
        seq_ids, token_ids, logprobs = [], [], []
        for seq, n in work:
            seq.num_computed += n
            self.tokens_computed += n
            if seq.num_computed == len(seq.token_ids):
                assert seq.grammar is None or seq.seq_id in self.ready or seq.prompt_len == 1, \
                    f"seq {seq.seq_id} samples before its grammar was reported ready"
                tok = self.model(seq.hashes[-1])
                seq.token_ids.append(tok)
                extend_hashes(seq.hashes, seq.token_ids)
                seq_ids.append(seq.seq_id)
                token_ids.append(tok)
                logprobs.append(-0.5)
        for sid, left in self.compiling.items():
            self.compiling[sid] = max(0, left - 1)
        ready, errors = self._grammar_outcomes()
        return StepResult(step=plan.step, seq_ids=seq_ids, token_ids=token_ids, logprobs=logprobs,
                          grammars_ready=ready, seq_errors=errors)

    def _grammar_outcomes(self) -> tuple[list[int], list[SeqError]]:
        """The held sequences whose grammar finished compiling, each reported once an admission."""
        ready: list[int] = []
        errors: list[SeqError] = []
        for sid in sorted(self.unreported):
            if sid not in self.seqs:
                self.unreported.discard(sid)
            elif self.compiling[sid] == 0:
                self.unreported.discard(sid)
                if self.seqs[sid].grammar == BAD_GRAMMAR:
                    errors.append(SeqError(sid, "invalid_grammar", "the grammar engine refused it"))
                else:
                    ready.append(sid)
                    self.ready.add(sid)
        self.grammar_errors += errors
        return ready, errors

    def idle_status(self) -> GrammarStatus | None:
        """What the worker sends unasked while no step runs: time passes, so every compilation ends."""
        for sid in self.compiling:
            self.compiling[sid] = 0
        ready, errors = self._grammar_outcomes()
        return GrammarStatus(ready=ready, errors=errors) if ready or errors else None


def run_to_completion(engine, worker: SimWorker, max_steps: int = 10_000, check: bool = True,
                      held: deque[StepResult] | None = None) -> dict[str, list]:
    """Step engine + worker until idle; every request's outputs (in order) by request id.

    As many steps as the engine allows are planned before the oldest result is applied, so an engine with
    `max_inflight_steps = 2` runs the one-step-ahead pipeline (the worker computes step k+1 before the engine
    sees result k). `held`: results computed but not yet applied when the call starts."""
    outputs: dict[str, list] = {}
    held = held if held is not None else deque()
    for _ in range(max_steps):
        while engine.can_plan:
            plan = engine.plan_step()
            if plan is None:
                break
            held.append(worker.step(plan))
        if not held:
            status = worker.idle_status()  # (the worker loop's report of grammars compiled while it idles)
            if status is not None:
                engine.grammars_ready(status.ready)
                for err in engine.fail_sequences(status.errors):
                    outputs.setdefault(err.request_id, []).append(err)
                continue
            assert not engine.has_work, "the engine has work but plans nothing (a hang)"
            return outputs
        result = held.popleft()
        if result.seq_errors:  # (as the scheduler's service: before the result, whose tokens of theirs are void)
            for err in engine.fail_sequences(result.seq_errors):
                outputs.setdefault(err.request_id, []).append(err)
        for out in engine.apply_result(result):
            outputs.setdefault(out.request_id, []).append(out)
        if check:
            engine.check_invariants()
    raise AssertionError(f"not done after {max_steps} steps")


def tokens_of(outs: list) -> list[int]:
    return [t for o in outs for t in getattr(o, "token_ids", ())]  # (a RequestError has none: a failed grammar's)
