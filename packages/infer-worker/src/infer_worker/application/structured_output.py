"""Structured outputs (response_format, structured_outputs, forced tool calls): grammars compiled with xgrammar, one
matcher per constrained sequence. A grammar is a JSON Schema, a regex, an EBNF grammar or a structural tag (the
protocol's `StructuredOutput.kind`).

- Compilation runs off the hot path, on a small pool of background threads (`COMPILE_THREADS`), as soon as a
  sequence is admitted (it overlaps the prompt's prefill), and is cached by (kind, schema text): the server sends
  the schema canonically (sorted keys), so equal schemas share one compilation. A failed compilation is cached too.
- The scheduler holds a constrained sequence at its last prompt token until this book says its grammar is ready
  (`poll`: the worker reports it in `StepResult.grammars_ready`, or in a `GrammarStatus` when no step runs), so no
  step waits for a compilation. A schema xgrammar refuses, or one still compiling `COMPILE_TIMEOUT_S` after its
  compilation was asked for (a re-admission after a preemption does not reset it), fails that request alone
  (`poll`'s errors: the scheduler ends the request with that error). A timed-out compilation keeps its thread
  until it ends (xgrammar cannot be interrupted); the other threads of the pool go on with later grammars.
- A row that samples before its grammar is ready (a one-token prompt, which cannot be held; a rank that follows
  rank 0 under tensor parallelism; a recompute whose grammar the cache dropped meanwhile) waits at its first sample
  until the same deadline, as a fallback: that stalls the step.
- Rows with a grammar need logits processing (`process_until`) and read their own output, yet ride every step
  of the one-step-ahead pipeline: the scheduler plans them like free rows (only penalised rows wait for their
  token: `infer_core.plan.penalises_repeats`), so a grammar row's step k+1 launches with its last token still
  PENDING (`Sequence.reads_output` stays False: the worker does not collect step k first). At sampling, after
  step k+1's forward is queued, `prepare` feeds the matcher that token from the launch in flight
  (`pending_token`: `ModelRunner._pending_token`, step k's host copy, done by then on the device) with the
  others it has not seen (one a step; a whole output after a preemption's recompute), then the row's bitmask is
  filled (`mask` on the eager path, `prepare` + `fill` into the masked sampling graph's slot). No rollback, no
  speculation: the matcher only ever accepts sampled tokens.
- The matcher's stop tokens are the request's (EOS + stop_token_ids, as the scheduler stops on them): refused
  until the grammar is complete (a stop id that is ordinary text too), then only they are allowed, so the
  request ends with finish_reason "stop" and never mid-document.

Grammar state (compiled grammars, matchers) lives here, in the application layer, keyed by sequence id; the
domain only carries the request's `Grammar` value (kind + schema text) in its `Sampling`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from infer_protocol.messages import SeqError
from infer_worker.domain.sequence import PENDING, Grammar, Sequence

log = logging.getLogger("rustinfer.worker")

# How long a grammar may take to compile (from when its compilation was asked for, or from the moment the compiler
# was ready if that came later): past it, every request of that grammar fails with grammar_too_complex. The compiler
# itself (transformers, the vocabulary scan) is made on the first grammar, bounded apart.
COMPILE_TIMEOUT_S = 30.0
# Compilations at once: a grammar that runs past its deadline keeps its thread (xgrammar cannot be interrupted), and
# the others serve the grammars after it.
COMPILE_THREADS = 4
COMPILER_TIMEOUT_S = 300.0
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
_JSON_OBJECT_SCHEMA = '{"type": "object"}'

TokenizerInfoFactory = Callable[[int], Any]  # vocab size -> xgrammar.TokenizerInfo (loads the tokenizer)
_FOREVER = 2**62


# xgrammar (0.2.9) writes a string with maxLength / minLength as repeats of this class, which admits the control
# characters but CR and LF; JSON forbids them raw in a string (json.loads refuses a tab there). Seen on the H200: a
# random model's outputs held raw tabs and 7 of 16 did not parse. Its unbounded strings already exclude \0-\x1f.
_LAX_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def strict_json_strings(grammar: Any) -> Any:
    """The grammar with every JSON string character class that admits raw control characters made strict."""
    import xgrammar as xgr

    text = str(grammar)
    return grammar if _LAX_STRING_CHAR not in text else xgr.Grammar.from_ebnf(text.replace(_LAX_STRING_CHAR,
                                                                                            _JSON_STRING_CHAR))


def compile_spec(compiler: Any, spec: Grammar) -> Any:
    """The request's grammar compiled by an xgrammar GrammarCompiler (raises on a grammar it refuses)."""
    import xgrammar as xgr

    if spec.kind == "regex":
        return compiler.compile_regex(spec.schema)
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.schema)  # EBNF (GBNF), root rule `root`
    if spec.kind == "structural_tag":
        return compiler.compile_grammar(strict_json_strings(xgr.Grammar.from_structural_tag(spec.schema)))
    if spec.kind not in ("json_schema", "json_object"):
        raise ValueError(f"unknown grammar kind {spec.kind!r}")
    schema = spec.schema if spec.kind == "json_schema" else _JSON_OBJECT_SCHEMA
    # Compact JSON (no free whitespace): a model cannot wander into endless blank runs, and every output is
    # still valid JSON. strict_mode: no properties beyond the schema's (outputs still validate against it).
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return compiler.compile_grammar(strict_json_strings(grammar))


def constrain(seq: Sequence) -> None:
    """Route every sample of the sequence through logits processing (where the grammar masks it)."""
    seq.process_until = _FOREVER


@dataclass(slots=True, frozen=True)
class _Compilation:
    """One grammar's compilation (cached by kind and text, shared by every sequence with that grammar)."""

    future: Future
    asked: float  # time.monotonic() when it was submitted to the pool: its deadline runs from here


@dataclass(slots=True)
class _Row:
    """One constrained sequence: its grammar (compiling or compiled), its matcher once that is ready."""

    compiled: _Compilation
    stop_token_ids: list[int]
    matcher: Any = None
    consumed: int = 0  # generated tokens the matcher has accepted
    failed: bool = False  # reported once; from then on the row is sampled unconstrained (its tokens are void)
    reported: bool = False  # the scheduler was told the grammar is ready, or failed (poll, or a failed sample)


@dataclass
class GrammarBook:
    """The compiled grammars and the per-sequence matchers of one worker."""

    tokenizer_info: TokenizerInfoFactory | None
    vocab_size: int
    timeout_s: float = COMPILE_TIMEOUT_S
    threads: int = field(default_factory=lambda: fill_threads())  # of the batched bitmask fill
    _rows: dict[int, _Row] = field(default_factory=dict)
    _cache: OrderedDict[tuple[str, str], _Compilation] = field(default_factory=OrderedDict)
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(COMPILE_THREADS, "grammar-compile"))
    _unreported: dict[int, _Row] = field(default_factory=dict)  # rows whose readiness poll has not reported yet
    _compiler: Any = None
    _compiler_ready: float | None = None  # time.monotonic() when the compiler was made
    _compiler_error: Exception | None = None  # why it could not be made (kept: a retry would take as long again)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ready: threading.Event = field(default_factory=threading.Event)  # set once the compiler exists (or failed)
    pending_resolved: int = 0  # tokens fed from a launch still in flight (tests and logs read it)
    _batch: Any = None  # xgrammar.BatchGrammarMatcher (its thread pool fills the step's bitmasks), made on first use
    _host: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))  # see _buffers
    _host_rows: int = 0
    _host_words: int = 0
    _bits: torch.Tensor | None = None  # see _bit_values

    # ------------------------------------------------------------------ lifecycle (the worker service)

    def admit(self, seq: Sequence) -> None:
        """A sequence with a grammar arrived (new, or recomputed after a preemption): start compiling its grammar
        and route its rows through logits processing."""
        spec = seq.sampling.structured
        assert spec is not None
        constrain(seq)
        row = _Row(self._compile(spec), list(seq.stop_token_ids))
        self._rows[seq.seq_id] = row
        self._unreported[seq.seq_id] = row

    def forget(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        self._unreported.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def compiling(self) -> bool:
        """Some admitted row's readiness is not reported yet (the worker loop polls while so)."""
        return bool(self._unreported)

    def poll(self) -> tuple[list[int], list[SeqError]]:
        """(the rows whose grammar is compiled, the rows whose grammar failed: refused, or past its deadline), each
        reported once. Never waits: the worker reports them in the next StepResult, or in a GrammarStatus when no
        step is in flight, and the scheduler lets a held row sample once it is ready."""
        if not self._unreported:
            return [], []
        ready: list[int] = []
        errors: list[SeqError] = []
        now = time.monotonic()
        for seq_id, row in list(self._unreported.items()):
            if row.reported:  # (a sample resolved it first: the fallback wait)
                del self._unreported[seq_id]
                continue
            try:
                if not row.compiled.future.done() and now < self._deadline(row.compiled):
                    continue
                self._matcher(row, wait=False)
            except _RowFailed as exc:
                row.failed = True
                errors.append(SeqError(seq_id, exc.code, exc.message, exc.status))
            else:
                ready.append(seq_id)
            row.reported = True
            del self._unreported[seq_id]
        return ready, errors

    def _deadline(self, compilation: _Compilation) -> float:
        """When the compilation is past its time (never before the compiler exists, which has a bound of its own)."""
        if not self._ready.is_set():
            return compilation.asked + COMPILER_TIMEOUT_S + self.timeout_s
        return max(compilation.asked, self._compiler_ready or 0.0) + self.timeout_s

    def _compile(self, spec: Grammar) -> _Compilation:
        key = (spec.kind, spec.schema)
        compilation = self._cache.get(key)
        if compilation is not None:
            self._cache.move_to_end(key)
            return compilation
        compilation = _Compilation(self._pool.submit(self._compile_now, spec), time.monotonic())
        self._cache[key] = compilation
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return compilation

    def _compile_now(self, spec: Grammar) -> Any:
        import xgrammar as xgr  # here, not at import: a worker that never sees a grammar never loads it

        with self._lock:
            if self._compiler_error is not None:
                raise self._compiler_error
            if self._compiler is None:
                try:
                    if self.tokenizer_info is None:
                        raise RuntimeError("structured outputs need the model's tokenizer, which this worker lacks")
                    started = time.perf_counter()
                    self._compiler = xgr.GrammarCompiler(self.tokenizer_info(self.vocab_size), max_threads=1)
                    self._compiler_ready = time.monotonic()
                    log.info("grammar compiler ready in %.1f s", time.perf_counter() - started)
                except Exception as exc:
                    self._compiler_error = exc
                    log.error("structured outputs are unavailable: %s", exc)
                    raise
                finally:
                    self._ready.set()
        return compile_spec(self._compiler, spec)

    # ------------------------------------------------------------------ the step (the model runner)

    def mask(self, logits: torch.Tensor, seqs: Seq[Sequence], rows: Seq[int],
             to_device: Callable[[Any], torch.Tensor],
             pending_token: Callable[[Sequence], int] | None = None) -> list[SeqError]:
        """Mask (in place: `logits` is the processed float32 copy) every token each grammar row's matcher refuses.
        `pending_token(seq)`: the id a step still in flight sampled for a row whose last token is PENDING (the
        one-step-ahead pipeline plans grammar rows into every step). `to_device` is given a view of this book's
        reusable host buffer: it must be done reading it when it returns (a copy; or, on the CPU, a view that
        only this call uses). Returns the rows that failed on their own (left unmasked)."""
        masked, matchers, errors = self.prepare(seqs, rows, pending_token)
        if masked:
            self._apply(logits, masked, matchers, to_device)
        return errors

    def prepare(self, seqs: Seq[Sequence], rows: Seq[int], pending_token: Callable[[Sequence], int] | None = None
                ) -> tuple[list[int], list[Any], list[SeqError]]:
        """(the rows to mask, their matchers fed every generated token, the rows that failed on their own): the
        rows a `fill` then writes the bitmasks of (terminated and failed rows are left out, unmasked)."""
        errors: list[SeqError] = []
        masked: list[int] = []
        matchers: list[Any] = []
        for row in rows:
            seq = seqs[row]
            state = self._rows.get(seq.seq_id)
            if state is None:  # admitted before this book existed: never the case in a worker, but not silent
                errors.append(SeqError(seq.seq_id, "structured_output_unavailable",
                                       "this worker has no grammar engine", 500))
                continue
            if state.failed:
                continue
            try:
                self._sync(state, seq, pending_token)
            except _RowFailed as exc:
                state.failed = state.reported = True
                errors.append(SeqError(seq.seq_id, exc.code, exc.message, exc.status))
                continue
            if state.matcher.is_terminated():
                # It accepted its stop token, so the scheduler finished it; with the one-step-ahead pipeline it
                # was already planned into this step: its token here is void, nothing to mask.
                continue
            masked.append(row)
            matchers.append(state.matcher)
        return masked, matchers, errors

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        """The matchers' next-token bitmasks into `bitmask` `[len(matchers), words]` int32 (host), in one call."""
        self._batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, debug_print=False)

    def _apply(self, logits: torch.Tensor, masked: list[int], matchers: list[Any],
               to_device: Callable[[Any], torch.Tensor]) -> None:
        """Fill the rows' bitmasks in one call (xgrammar's thread pool) and set every refused logit to -inf."""
        k, words = len(masked), (logits.shape[-1] + 31) // 32
        head, bitmask = self._buffers(k, words)
        self.fill(matchers, bitmask)
        head.view(np.int64)[:k] = masked
        # One copy carries both the row indices (the head, as int64) and the packed words (vocab / 8 bytes a row),
        # unpacked where the logits are: unpacking on the host would build and copy 32x the bytes (a bool a token).
        flat = to_device(self._host[: head.size + k * words])
        index = flat[: head.size].view(torch.int64)[:k]
        bits = flat[head.size:].view(k, words)
        refused = refused_tokens(bits, self._bit_values(bits.device), logits.shape[-1])
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(refused, float("-inf")))

    def _buffers(self, rows: int, words: int) -> tuple[np.ndarray, torch.Tensor]:
        """The reused host buffer as (head: 2 int32 slots a row, for its int64 logits row; the [rows, words]
        bitmask xgrammar fills), grown when a step has more grammar rows than any before: no allocation a step
        (xgr.allocate_token_bitmask a step: a fresh 0.6 MB at 16 rows of Qwen3, page faults included)."""
        if self._host_rows < rows or self._host_words != words:
            self._host_rows, self._host_words = max(rows, 2 * self._host_rows), words
            self._host = np.empty(2 * self._host_rows + self._host_rows * words, dtype=np.int32)
        head = 2 * self._host_rows
        bitmask = torch.from_numpy(self._host[head: head + rows * words]).view(rows, words)
        return self._host[:head], bitmask

    def _batch_matcher(self) -> Any:
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
        return self._batch

    def _bit_values(self, device: torch.device) -> torch.Tensor:
        """bit_values on the logits' device, made once a book (its one blocking copy)."""
        if self._bits is None or self._bits.device != device:
            self._bits = bit_values(device)
        return self._bits

    def _sync(self, state: _Row, seq: Sequence, pending_token: Callable[[Sequence], int] | None) -> None:
        """The row's matcher, created once its grammar is compiled, fed the generated tokens it has not seen."""
        if state.matcher is None:
            self._matcher(state, wait=True)
        generated = seq.token_ids[seq.prompt_len + state.consumed:]
        for token in generated:
            if token == PENDING:  # (only a row's last token can be: the previous launch is sampling it)
                if pending_token is None:
                    raise _RowFailed("internal_error", "a constrained row's token is still pending", 500)
                token = pending_token(seq)
                self.pending_resolved += 1
            if not state.matcher.accept_token(token):
                raise _RowFailed("internal_error", f"the grammar refused token {token} it allowed", 500)
            state.consumed += 1

    def _matcher(self, state: _Row, wait: bool) -> None:
        """Make the row's matcher from its compiled grammar: `wait` for the compilation until its deadline (the
        fallback of a row that samples before the scheduler heard it is ready), or not (`poll`, which calls only
        once the compilation is done or past its deadline). Raises _RowFailed for a grammar that failed."""
        compilation = state.compiled
        if wait:
            self._ready.wait(COMPILER_TIMEOUT_S)
        try:
            timeout = max(0.0, self._deadline(compilation) - time.monotonic()) if wait else 0.0
            compiled = compilation.future.result(timeout=timeout)
        except FutureTimeout:
            raise _RowFailed("grammar_too_complex", f"the grammar did not compile within "
                             f"{self.timeout_s:g} s", 400) from None
        except Exception as exc:  # xgrammar refuses the schema (or no tokenizer)
            raise _RowFailed("invalid_grammar", f"the grammar engine refused it: {_first_line(exc)}",
                             400) from None
        if not state.stop_token_ids:
            raise _RowFailed("invalid_grammar", "a grammar needs a stop token to end the output (the "
                             "model names no EOS)", 400)
        if state.matcher is None:
            import xgrammar as xgr

            state.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=state.stop_token_ids)


def bit_values(device: torch.device | str) -> torch.Tensor:
    """[32] int32, bit i set in entry i: built on the host as uint32 (1 << 31 is int32's sign bit, which a signed
    shift need not give), then copied (a blocking copy: make it once)."""
    values = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32)).view(np.int32)
    return torch.from_numpy(values).to(device)


def refused_tokens(words: torch.Tensor, bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[rows, vocab]` bool, True where a token's bit is clear in its row of packed `words` `[rows, words]` int32
    (bit i of word j is token 32 j + i, xgrammar's layout); `bits` is `bit_values` on the words' device."""
    return ((words[:, :, None] & bits) == 0).view(words.shape[0], -1)[:, :vocab]


FILL_THREADS_ENV = "INFER_GRAMMAR_FILL_THREADS"


def fill_threads(environ: Mapping[str, str] = os.environ) -> int:
    """Threads of the batched bitmask fill: `INFER_GRAMMAR_FILL_THREADS`, else 1 (the calling thread). On the H200
    the structured batch (64 rows, 16 under a schema) measured B/A 1.61 with 8 threads (and the decode graphs that
    stop at the logits) against 1.40 with the rows filled one after another, and the A/B of the sixth session
    put 16 rows' fill at 1.95 ms on 8 threads against 0.46 ms on one (docs/benchmarks.md): a row's fill is
    ~30 us of C++ and xgrammar may start its pool's threads at each call. Capped at half the usable cores."""
    try:
        cores = len(os.sched_getaffinity(0))  # (the cores this process may use: a container's limit, not the host's)
    except AttributeError:  # (not on Linux)
        cores = os.cpu_count() or 1
    try:
        wanted = int(environ.get(FILL_THREADS_ENV, "1"))
    except ValueError:
        raise ValueError(f"{FILL_THREADS_ENV} must be an integer, got {environ[FILL_THREADS_ENV]!r}") from None
    return max(1, min(wanted, cores // 2 or 1))


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its C++ source location (`[hh:mm:ss] /project/cpp/x.cc:94: `)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)


class _RowFailed(Exception):
    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status
