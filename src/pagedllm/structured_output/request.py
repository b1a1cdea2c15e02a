"""One request's structured output: its grammar, compiled off the busy loop, and the matcher that follows its
tokens (vLLM's `StructuredOutputRequest`). The scheduler sees only `is_ready()`, `accept_tokens()` and
`validate_tokens()`."""

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

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (a request's draft tokens) the grammar allows after the tokens accepted
        so far; the matcher does not move. Drafts are cut there before they are scheduled, as vLLM's scheduler cuts
        them: a draft the grammar refuses would be rejected by the verify step anyway. A failed compile, or a
        grammar that has stopped (only EOS may follow), allows no drafts."""
        if self.matcher is None or not token_ids or self.matcher.is_stopped():
            return []
        return token_ids[:self.matcher.validate_tokens(token_ids)]
