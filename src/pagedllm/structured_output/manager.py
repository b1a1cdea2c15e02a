"""StructuredOutputManager: compiles grammars in two big-stack worker threads, small and big grammars apart (with
a cache keyed by grammar and tokenizer), computes each constrained request's next mask ahead of its step on a
mask thread, and, each step, gathers the token bitmask of the rows that sample under a grammar (vLLM's
`StructuredOutputManager`). The engine core owns it; only the busy loop's thread calls `grammar_bitmask` and
`wait_for_masks`.

Masks ahead of the step (issue 32): a grammar whose masks cost tens of milliseconds per token used to stretch
every step, so one constrained request slowed every stream. Now the engine waits for pending masks at most a
budget per step (engine/core.py), and the scheduler leaves out of the step a request whose mask is still not
ready (structured_output/request.py), so only that request waits for its mask."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend_guidance import GuidanceBackend
from pagedllm.structured_output.bounds import COMPILE_NICE, SMALL_GRAMMAR_BYTES, BigStackExecutor
from pagedllm.structured_output.grammar import grammar_of
from pagedllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

COMPILE_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


@dataclass
class GrammarOutput:
    """A step's masks: row `req_id_to_row[r]` of `bitmask` ([rows, ceil(V / 32)] int32) is request r's mask for its
    next token; when r verifies k drafts this step, rows +1..+k are its masks after each draft prefix."""

    req_id_to_row: dict[str, int]
    bitmask: np.ndarray


@dataclass
class GrammarStats:
    """Since the last snapshot: grammars compiled (cache misses), their seconds, and cache hits."""

    num_compiles: int = 0
    compile_seconds: float = 0.0
    num_cache_hits: int = 0


class StructuredOutputManager:
    """Args:
        config: the backend choice and server-wide JSON options.
        load_tokenizer: builds the model's tokenizer; called once, in the compile worker, on the first request.
        vocab_size: rows of the model's logits.
    """

    def __init__(self, config: StructuredOutputsConfig, load_tokenizer: Callable, vocab_size: int):
        self.config = config
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._backend: GuidanceBackend | None = None
        # llguidance recurses natively: big stacks (bounds.py); a small grammar never queues behind a big one
        # and they yield the cores to the model's steps (bounds.COMPILE_NICE)
        self._small_worker = BigStackExecutor("grammar-compile", nice=COMPILE_NICE)
        self._big_worker = BigStackExecutor("grammar-compile-big", nice=COMPILE_NICE)
        self._cache: OrderedDict[str, object] = OrderedDict()  # grammar text -> matcher at its start
        self._lock = threading.Lock()  # the cache, the stats
        self._backend_lock = threading.Lock()
        self._stats = GrammarStats()
        self._bitmask: np.ndarray | None = None
        self._mask_worker = BigStackExecutor("grammar-mask")
        """Computes requests' next masks ahead of their steps (one thread: llguidance drops the GIL in a mask, and
        a second thread would only take the model's cores)."""
        self._pending_masks: set[Future] = set()
        self._pending_lock = threading.Lock()

    def add_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start compiling a request's grammar in the worker; the request waits (WAITING_FOR_FSM) until it is
        ready. Params up to SMALL_GRAMMAR_BYTES (as msgpack) compile in one worker, bigger ones in another. The
        grammar text is made in the worker too: for a 2,000-branch schema, grammar_of and its bounds walk took
        50-300 ms of the busy loop, a gap in every stream (issue 32, item 3). Params past the bounds of bounds.py
        (the frontend checks them first) fail that request alone: its compile raises StructuredOutputError, and
        the request can only end."""
        try:
            size = len(msgspec.msgpack.encode(params))
        except (msgspec.EncodeError, TypeError, UnicodeEncodeError):
            size = SMALL_GRAMMAR_BYTES + 1  # grammar_of refuses it, in the worker
        worker = self._small_worker if size <= SMALL_GRAMMAR_BYTES else self._big_worker
        return StructuredOutputRequest(worker.submit(self._compile_params, params), self._mask_worker,
                                       self._compute_mask, self._track_mask, params.reasoning_end_token_ids)

    def _compile_params(self, params: StructuredOutputsParams):
        """In a worker: the grammar of `params` (raises StructuredOutputError past the bounds), then _compile."""
        return self._compile(grammar_of(params, self.config.disable_any_whitespace,
                                        self.config.disable_additional_properties))

    def _compile(self, grammar: str):
        """In a worker: a matcher for `grammar` at its start, copied from the cache or compiled."""
        backend = self._get_backend()
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                self._stats.num_cache_hits += 1
        if template is not None:
            return template.deep_copy()
        start = time.perf_counter()
        template = backend.compile(grammar)
        seconds = time.perf_counter() - start
        if template.is_error():
            logger.warning("grammar does not compile: %s", template.get_error()[:500])
        with self._lock:
            if not template.is_error():
                self._cache[grammar] = template
                if len(self._cache) > COMPILE_CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._stats.num_compiles += 1
            self._stats.compile_seconds += seconds
        return template.deep_copy()

    def _get_backend(self) -> GuidanceBackend:
        with self._backend_lock:  # both workers may ask first
            if self._backend is None:
                start = time.perf_counter()
                self._backend = GuidanceBackend(self._load_tokenizer(), self.vocab_size)
                logger.info("structured outputs: llguidance ready for a vocabulary of %d tokens in %.2f s",
                            self._backend.vocab_size, time.perf_counter() - start)
            return self._backend

    def _compute_mask(self, matcher, drafts: Sequence[int]) -> np.ndarray:
        """On the mask thread: a request's rows for its next step, [1 + len(drafts), words] (as grammar_bitmask
        fills them: its mask now, then after each draft prefix)."""
        backend = self._backend  # set by the compile that made the matcher
        rows = backend.allocate_bitmask(1 + len(drafts))
        rows.fill(0)
        backend.fill_bitmask([(matcher, 0, drafts)], rows)
        return rows

    def _track_mask(self, job: Future) -> None:
        with self._pending_lock:
            self._pending_masks.add(job)
        job.add_done_callback(self._untrack_mask)

    def _untrack_mask(self, job: Future) -> None:
        with self._pending_lock:
            self._pending_masks.discard(job)

    def wait_for_masks(self, timeout_s: float, any_one: bool = False) -> bool:
        """Wait up to timeout_s for every mask being computed (any_one: for the first of them to finish).
        Returns whether none is pending any more (any_one: whether one finished or none was pending)."""
        with self._pending_lock:
            pending = list(self._pending_masks)
        if not pending:
            return True
        done, not_done = wait_futures(pending, timeout=timeout_s,
                                      return_when=FIRST_COMPLETED if any_one else ALL_COMPLETED)
        return bool(done) if any_one else not not_done

    def take_stats(self) -> GrammarStats:
        """The counters since the previous call."""
        with self._lock:
            stats, self._stats = self._stats, GrammarStats()
        return stats

    def grammar_bitmask(self, requests: Mapping[str, Request], scheduler_output: SchedulerOutput
                        ) -> GrammarOutput | None:
        """The masks of this step's rows that sample under a grammar (None: no such row).

        A request samples when the step's tokens reach the end of its tokens (scheduled num_computed_tokens,
        which already counts this step, is at least its num_tokens). Its first row is the mask for its next token;
        with k drafts scheduled, k rows follow: the masks after each draft prefix (the verify step's rows, vLLM's
        layout), so every token the verify step emits, the bonus token included, is one the grammar allows after
        the tokens before it. A row that would allow nothing gets EOS, so the request can always end.
        Rows computed ahead on the mask thread are copied; the others (none when the scheduler waited for them)
        are computed here.
        """
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        rows: dict[str, int] = {}
        live = []  # (matcher, first row, drafts): computed here
        ahead = []  # (rows computed on the mask thread, first row)
        num_rows = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            so_request = request.structured_output_request if request is not None else None
            if (so_request is None or so_request.in_reasoning
                    or request.num_computed_tokens < len(request.all_token_ids)):
                continue
            drafts = spec_tokens.get(req_id, ()) if spec_tokens else ()
            rows[req_id] = num_rows
            if so_request.matcher is not None:
                ready = so_request.mask_rows(drafts)
                if ready is None:
                    live.append((so_request.matcher, num_rows, drafts))
                else:
                    ahead.append((ready, num_rows))
            num_rows += 1 + len(drafts)
        if not rows:
            return None
        backend = self._backend
        if backend is None:  # every compile failed before the backend existed
            return None
        bitmask = self._rows(backend, num_rows)
        bitmask.fill(0)
        for ready, row in ahead:
            bitmask[row:row + len(ready)] = ready
        if live:
            backend.fill_bitmask(live, bitmask)
        dead = np.flatnonzero(~bitmask.any(axis=1))
        if len(dead) and backend.eos_token_id is not None:
            eos = backend.eos_token_id
            bitmask[dead, eos // 32] |= np.array([1 << (eos % 32)], dtype=np.uint32).view(np.int32)[0]
        return GrammarOutput(rows, bitmask)

    def _rows(self, backend: GuidanceBackend, num_rows: int) -> np.ndarray:
        """A view of num_rows rows of a reused buffer (the runner reads it before the next step fills it)."""
        if self._bitmask is None or len(self._bitmask) < num_rows:
            self._bitmask = backend.allocate_bitmask(max(num_rows, 8))
        return self._bitmask[:num_rows]

    def shutdown(self) -> None:
        self._small_worker.shutdown(wait=False, cancel_futures=True)
        self._big_worker.shutdown(wait=False, cancel_futures=True)
        self._mask_worker.shutdown(wait=False, cancel_futures=True)
