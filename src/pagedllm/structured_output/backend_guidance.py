"""The llguidance backend: the tokenizer's vocabulary as llguidance sees it, a grammar's matcher, and a batch's
token bitmask, all done by the library (vLLM's `backend_guidance.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np


class GuidanceBackend:
    """Compiles grammars for one tokenizer and fills their masks.

    Args:
        tokenizer: the model's (fast) Hugging Face tokenizer.
        vocab_size: rows of the model's logits; the masks cover max(vocab_size, the tokenizer's size) tokens.
    """

    def __init__(self, tokenizer, vocab_size: int):
        n_vocab = max(vocab_size, len(tokenizer))
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)
        self.vocab_size = n_vocab
        self.eos_token_id = tokenizer.eos_token_id

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start. Never raises for a bad grammar: the matcher is then in its
        error state (`is_error()`) and its mask allows only EOS."""
        return llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmask(self, matchers: list[tuple[llguidance.LLMatcher, int, Sequence[int]]], bitmask: np.ndarray
                     ) -> None:
        """Row i of `bitmask` := the tokens matcher (m, i, drafts) allows next (bit t of word t // 32 set: token t
        is allowed); with drafts d_0..d_{k-1} (speculative decoding), row i + 1 + j := the tokens it allows after
        d_0..d_j, the verify step's row for the token after d_j. The drafts are consumed one by one and rolled back,
        so every matcher ends where it started. Rows after a draft the grammar refuses, or after the grammar has
        stopped (only EOS may follow, and EOS ends the request), are left as they are: the verify step never
        emits tokens from them (a refused draft is rejected at its own row, which forbids it).

        One row after the other, on the calling thread: a row takes ~25 us of CPU on SmolLM2's vocabulary, and
        llguidance's parallel executor keeps worker threads that compete with the model's on a small CPU."""
        fill = llguidance.numpy.fill_next_token_bitmask
        for matcher, row, drafts in matchers:
            fill(matcher, bitmask, row)
            if not drafts:
                continue
            num_consumed = 0
            for token in drafts[:matcher.validate_tokens(list(drafts))]:
                if matcher.is_stopped():  # a stopped matcher does not record what it is given: nothing to roll back
                    break
                matcher.consume_token(token)
                num_consumed += 1
                fill(matcher, bitmask, row + num_consumed)
            if num_consumed:
                matcher.rollback(num_consumed)
