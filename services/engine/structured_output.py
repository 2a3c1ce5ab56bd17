"""Structured outputs in the engine (vLLM V1's StructuredOutputManager): grammars compiled once per
constraint, off the engine loop; one matcher per request, advanced by every token it accepts; the
step's packed token bitmask for the requests that sample under a grammar.

    add_request ──► submit(): the constraint's compiled grammar from the LRU cache, or a compile on
                    one of the pool's threads. The request waits (EngineCore holds it back) until ready().
    schedule()  ──► Speculator.draft ──► RequestGrammar.valid_drafts(drafts): the drafts cut to
                    the grammar's longest accepted prefix (speculative decoding)
                ──► bitmask(requests sampling now): one mask row per sampled position ──► worker
    update_from_output ──► RequestGrammar.accept(tokens kept): the matcher moves on
    next schedule()    ──► a complete grammar ends its request (EngineCore._finish_complete_grammars)

A request with d drafts x_1..x_d samples at d + 1 positions; row j of its mask is the grammar's state
after its outputs and x_1..x_j, built by consuming the drafts and rolling them back. A matcher
accepts only the tokens a request keeps (its accepted drafts and the token drawn after them): a
step's token that arrives for a request preempted meanwhile is dropped before it reaches the
matcher, and a request resumed after preemption keeps its outputs, so its matcher is exactly where
its outputs left it. Nothing outlives the request but the cached compiled grammar.

What a compile may cost is bounded twice: the constraint's bounds (GrammarLimits, checked in linear
time before anything is built) and llguidance's own fuel limits, which end a lexer or grammar too
costly to build inside the compile itself. The compile timeout only ends a request's wait; those
two bounds end the work. Compiles release the GIL and run on several threads, so one costly grammar
neither stalls the engine loop nor holds back the other requests' compiles.

The engine reads the vocabulary from the worker's tokenizer.json (llguidance's own tokenizer, no
transformers): the engine and the worker share a machine or a volume, or structured outputs fail
with a clear error.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import llguidance
import numpy as np
from llguidance.numpy import (fill_next_token_bitmask, fill_next_token_bitmask_par,
                              fill_next_token_bitmask_par_with_draft_tokens)

from services.common.config import GrammarLimits
from services.common.grammar import MAX_ERROR_CHARS, checked_grammar, parser_limits
from services.common.structured_outputs import StructuredOutputs

TOKENIZER_FILE = "tokenizer.json"
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (llguidance's are small: states are built lazily)
DEFAULT_COMPILE_TIMEOUT: float = GrammarLimits.grammar_compile_timeout  # seconds a request waits for its grammar
DEFAULT_COMPILE_THREADS: int = GrammarLimits.grammar_compile_threads


class GrammarError(ValueError):
    """A constraint that did not compile (bad schema, regex or grammar; too slow): the request fails
    alone, and the caller gets a 400."""


class RequestGrammar:
    """One request's matcher: a copy of its constraint's compiled grammar."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: llguidance.LLMatcher) -> None:
        self.matcher = compiled.deep_copy()

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Move on by the tokens a step kept; False when the grammar refuses one (the mask let it
        through: only an all-masked row, whose sampler picks any token, can do that)."""
        # One at a time: consume_tokens refuses the end of sequence once the grammar is complete.
        return all(self.matcher.consume_token(t) for t in token_ids) and not self.matcher.is_error()

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts, short of a draft that completes it: the
        draw after such a draft would have nothing left to sample (without speculation the request
        ends on that token). The matcher is left where it was."""
        num_valid = self.matcher.try_consume_tokens(drafts)
        keep = num_valid
        while keep and self.matcher.is_stopped():
            self.matcher.rollback(1)
            keep -= 1
        self.matcher.rollback(keep)
        return drafts[:keep]

    @property
    def is_complete(self) -> bool:
        """Nothing but the end of the sequence may follow: the request is done."""
        return self.matcher.is_stopped()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)


class PendingGrammar(NamedTuple):
    future: Future
    submitted: float  # time.monotonic()


class StructuredOutputManager:
    """Engine-loop thread only (the compile pool's threads touch nothing but their own compile)."""

    def __init__(self, model_path: str | Path, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT, max_workers: int = DEFAULT_COMPILE_THREADS,
                 limits: GrammarLimits = GrammarLimits()) -> None:
        self.tokenizer_file = Path(model_path) / TOKENIZER_FILE
        self.vocab_size = vocab_size  # the logits' width: a mask row covers every logit
        self.words_per_row = (vocab_size + 31) // 32
        self.cache_size = cache_size
        self.compile_timeout = compile_timeout
        self.limits = limits  # what a constraint may hold (the processor checked it too: the engine trusts no caller)
        self._cache: OrderedDict[tuple[StructuredOutputs, tuple[int, ...]], Future] = OrderedDict()
        self._pending: dict[str, PendingGrammar] = {}  # request id -> its grammar being compiled
        self._pool = ThreadPoolExecutor(max_workers, "grammar-compile")
        self._executor: llguidance.LLExecutor | None = None  # llguidance's mask-filling threads, on first use
        self._tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}  # by eos ids
        self._tokenizer_lock = threading.Lock()
        self.cache_hits = self.cache_misses = 0  # read by the metrics when scraped
        # Called with each successful compile's seconds, on the compile thread (the metrics' histogram).
        self.compile_observers: list[Callable[[float], None]] = []

    # ------------------------------------------------------------------ compile

    def submit(self, request_id: str, constraint: StructuredOutputs, eos_token_ids: Sequence[int]) -> None:
        """Start (or find) the compile of `constraint` for `request_id`; see ready()."""
        key = (constraint, tuple(sorted(eos_token_ids)))
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.cache_hits += 1
        else:
            self.cache_misses += 1
            future = self._pool.submit(self._compile, constraint, key[1])
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._pending[request_id] = PendingGrammar(future, time.monotonic())

    def ready(self, request_id: str) -> RequestGrammar | None:
        """The request's grammar once compiled (its pending entry is gone then); None while it
        compiles. GrammarError when the compile failed or outlasted the time bound."""
        future, submitted = self._pending[request_id]
        if not future.done():
            if time.monotonic() - submitted <= self.compile_timeout:
                return None
            del self._pending[request_id]
            raise GrammarError(f"the grammar did not compile within {self.compile_timeout:g} s")
        del self._pending[request_id]
        error = future.exception()
        if error is not None:
            raise error if isinstance(error, GrammarError) else GrammarError(str(error))
        return RequestGrammar(future.result())

    def forget(self, request_id: str) -> None:
        """An aborted request's wait ends (its compile, if still running, only fills the cache)."""
        self._pending.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _compile(self, constraint: StructuredOutputs, eos_token_ids: tuple[int, ...]) -> llguidance.LLMatcher:
        start = time.perf_counter()
        tokenizer = self._tokenizer(eos_token_ids)
        try:
            grammar = checked_grammar(constraint, self.limits)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(f"invalid {constraint.kind}: {matcher.get_error().strip()[:MAX_ERROR_CHARS]}")
        for observe in self.compile_observers:
            observe(time.perf_counter() - start)
        return matcher

    def _tokenizer(self, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if eos_token_ids not in self._tokenizers:
                if not self.tokenizer_file.is_file():
                    raise GrammarError(f"structured outputs need the model's {TOKENIZER_FILE} on the engine; "
                                       f"{self.tokenizer_file} is not there")
                self._tokenizers[eos_token_ids] = llguidance.LLTokenizer(
                    self.tokenizer_file.read_text(), n_vocab=self.vocab_size,
                    eos_token=list(eos_token_ids) or None)
            return self._tokenizers[eos_token_ids]

    # ------------------------------------------------------------------ per step

    def bitmask(self, grammars: Sequence[RequestGrammar], drafts: Sequence[Sequence[int]] = ()) -> bytes:
        """The packed masks of `grammars`' next tokens, in order: grammar i has 1 + len(drafts[i])
        rows, row j masking the token after its first j drafts (already cut by valid_drafts). Several
        rows are filled by llguidance's own thread pool, in parallel and without the GIL."""
        drafts = drafts or [()] * len(grammars)
        num_rows = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(grammars))
        firsts = (np.cumsum(num_rows) - num_rows).tolist()
        drafting = [(g.matcher, first, list(d)) for g, first, d in zip(grammars, firsts, drafts) if d]
        # Zeros under drafts: a row llguidance did not write (it stops at a draft it refuses) forbids every token.
        bitmask = (np.zeros if drafting else np.empty)((int(num_rows.sum()), self.words_per_row), dtype=np.int32)
        if len(grammars) == 1 and not drafting:
            grammars[0].fill(bitmask, 0)
            return bitmask.tobytes()
        if len(drafting) < len(grammars):
            fill_next_token_bitmask_par(self._mask_executor(), [(g.matcher, first) for g, first, d
                                                                in zip(grammars, firsts, drafts) if not d], bitmask)
        if drafting:
            fill_next_token_bitmask_par_with_draft_tokens(self._mask_executor(), drafting, bitmask)
        return bitmask.tobytes()

    def _mask_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
