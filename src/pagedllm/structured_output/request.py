"""One request's structured output: its grammar, compiled off the busy loop, and the matcher that follows its
tokens (vLLM's `StructuredOutputRequest`). The scheduler sees only `is_ready()` and `accept_tokens()`."""

from __future__ import annotations

import logging
from concurrent.futures import Future

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """Args:
        future: the compile worker's result, a matcher at the grammar's start.
    """

    __slots__ = ("future", "matcher", "failed")

    def __init__(self, future: Future):
        self.future = future
        self.matcher = None
        self.failed = False
        """The compile raised (the frontend validates first, so this is a backend failure): only EOS is allowed."""

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
        after min_tokens masked EOS) puts it in its error state, whose mask allows only EOS."""
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_tokens(token_ids)
