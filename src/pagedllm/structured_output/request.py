"""One request's structured output: its grammar, compiled off the busy loop, the matcher that follows its
tokens (vLLM's `StructuredOutputRequest`), and its next mask, computed off the busy loop too.

The scheduler sees only `is_ready()`, `is_mask_ready()`, `accept_tokens()`, `validate_tokens()` and
`prepare_mask()`. Once its tokens and drafts are known (after each step that sampled for it, and when its grammar
has compiled), the request's mask for its next step is computed on the manager's mask thread (llguidance drops the
GIL while it computes a mask). The scheduler leaves a request whose mask is not ready out of a step that would
sample for it (it keeps its place and its KV blocks, and joins the next step), so a grammar with costly masks
delays only its own request. A request that begins inside the model's reasoning (`reasoning_end_token_ids`, set by the
server's --reasoning-parser) is not constrained until it has sampled one of those tokens, as vLLM's
`reasoner.is_reasoning_end`: no mask, no matcher advance, and its drafts are cut before an end token (so the end
token is the last of its step and the token after it is sampled under the grammar).

The matcher is touched by one thread at a time: the mask job runs between a step's
update and the next step that samples for the request, and the busy loop's calls wait for a job still running.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedllm.structured_output.bounds import BigStackExecutor

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """Args:
        future: the compile worker's result, a matcher at the grammar's start.
        mask_pool: where masks are computed ahead of the step (its `submit`; None: the step computes them).
        compute_mask: (matcher, drafts) -> the request's rows ([1 + len(drafts), words] int32: its mask now, then
            after each draft prefix; see GuidanceBackend.fill_bitmask); called on `mask_pool`.
        on_mask_submitted: called with each mask job's future (the manager keeps the pending ones).
    """

    __slots__ = ("future", "matcher", "failed", "reasoning_end_token_ids", "_mask_pool", "_compute_mask",
                 "_on_mask_submitted", "_lock", "_mask", "_mask_drafts", "_mask_started")

    def __init__(self, future: Future, mask_pool: Executor | BigStackExecutor | None = None,
                 compute_mask: Callable[[object, Sequence[int]], np.ndarray] | None = None,
                 on_mask_submitted: Callable[[Future], None] | None = None,
                 reasoning_end_token_ids: Sequence[int] | None = None):
        self.future = future
        self.reasoning_end_token_ids = frozenset(reasoning_end_token_ids) if reasoning_end_token_ids else None
        """While set, the request is inside its reasoning and unconstrained; cleared by the first of these tokens."""
        self.matcher = None
        self.failed = False
        """The compile raised (the frontend validates first, so this is a backend failure): only EOS is allowed."""
        self._mask_pool = mask_pool if compute_mask is not None else None
        self._compute_mask = compute_mask
        self._on_mask_submitted = on_mask_submitted
        self._lock = threading.Lock()
        self._mask: Future | None = None
        """The mask job for the matcher's current state (None: none yet, or masks are computed by the step)."""
        self._mask_drafts: list[int] = []
        """The drafts that job's rows follow."""
        self._mask_started = False
        """A mask job was submitted once: the compile's callback, which may run after the scheduler has already
        started the first mask and even accepted tokens, must not start another on a matcher in use."""
        if self._mask_pool is not None:
            future.add_done_callback(self._compiled)

    def is_ready(self) -> bool:
        """Whether the grammar is compiled (or failed); the request leaves WAITING_FOR_FSM then."""
        if self.matcher is not None or self.failed:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher = self.future.result()
        except Exception:
            logger.exception("grammar compile failed; the request can only end")
            self.failed = True
        return True

    def accept_tokens(self, token_ids: list[int]) -> None:
        """Advance the matcher over sampled tokens. A token the grammar refuses (only EOS at a dead end, or
        after min_tokens masked EOS) puts it in its error state, whose mask allows only EOS. The mask computed
        ahead is for the state before: gone (prepare_mask starts the next one)."""
        if self.reasoning_end_token_ids is not None:
            ends = [i for i, token_id in enumerate(token_ids) if token_id in self.reasoning_end_token_ids]
            if not ends:
                return
            self.reasoning_end_token_ids = None  # the grammar starts after the end token
            token_ids = token_ids[ends[0] + 1:]
        self._wait_mask()
        with self._lock:
            self._mask = None
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_tokens(token_ids)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (a request's draft tokens) the grammar allows after the tokens accepted
        so far; the matcher does not move. Drafts are cut there before they are scheduled, as vLLM's scheduler cuts
        them: a draft the grammar refuses would be rejected by the verify step anyway. A failed compile, or a
        grammar that has stopped (only EOS may follow), allows no drafts."""
        if self.reasoning_end_token_ids is not None:
            ends = [i for i, token_id in enumerate(token_ids) if token_id in self.reasoning_end_token_ids]
            return token_ids[:ends[0]] if ends else token_ids
        self._wait_mask()
        if self.matcher is None or not token_ids or self.matcher.is_stopped():
            return []
        return token_ids[:self.matcher.validate_tokens(token_ids)]

    # ---- the next step's mask, ahead of the step ----

    @property
    def in_reasoning(self) -> bool:
        """Inside the model's reasoning: the step samples without this request's mask."""
        return self.reasoning_end_token_ids is not None

    def prepare_mask(self, drafts: Sequence[int]) -> None:
        """Start computing the mask for the request's next step (after accept_tokens, with the drafts it may
        verify then: validated, so the step verifies a prefix of them)."""
        if self._mask_pool is None or self.matcher is None or self.reasoning_end_token_ids is not None:
            return
        with self._lock:
            self._submit(list(drafts))

    def is_mask_ready(self) -> bool:
        """Whether the next step may sample for the request without waiting for its mask."""
        if self._mask_pool is None or self.matcher is None or self.reasoning_end_token_ids is not None:
            return True  # masks computed by the step (none in the reasoning); a failed compile's (EOS) costs nothing
        with self._lock:
            if self._mask is None:  # compiled a moment ago: its callback has not run yet
                self._submit([])
            return self._mask is None or self._mask.done()

    def mask_rows(self, drafts: Sequence[int]) -> np.ndarray | None:
        """The ready rows for a step verifying `drafts` ([1 + len(drafts), words]), or None: not computed ahead
        for this state (the step computes them). Waits for a job still running (the scheduler samples for a
        request only once its mask is ready, so it does not)."""
        self._wait_mask()
        job = self._mask
        if job is None or job.cancelled() or job.exception() is not None:
            return None
        if list(drafts) != self._mask_drafts[:len(drafts)]:
            return None
        return job.result()[:1 + len(drafts)]

    def _compiled(self, future: Future) -> None:
        """The compile worker finished (on its thread): start the first mask at once."""
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            if not self._mask_started:
                self._submit([], future.result())

    def _submit(self, drafts: list[int], matcher=None) -> None:
        """Under the lock. A pool that is shut down leaves no job: the step computes the mask itself."""
        matcher = matcher if matcher is not None else self.matcher
        try:
            job = self._mask_pool.submit(self._compute_mask, matcher, drafts)
        except RuntimeError:  # the engine is shutting down
            self._mask = None
            self._mask_pool = None
            return
        self._mask, self._mask_drafts, self._mask_started = job, drafts, True
        if self._on_mask_submitted is not None:
            self._on_mask_submitted(job)

    def _wait_mask(self) -> None:
        job = self._mask
        if job is not None and not job.done():
            wait_futures([job])
