"""The llguidance backend: the tokenizer's vocabulary as llguidance sees it, a grammar's matcher, and a batch's
token bitmask, all done by the library (vLLM's `backend_guidance.py`)."""

from __future__ import annotations

import os

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
        # Mask fills run on the engine's thread; a second thread pays off only for batches of several rows.
        self.executor = llguidance.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 1) // 2)))

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start. Never raises for a bad grammar: the matcher is then in its
        error state (`is_error()`) and its mask allows only EOS."""
        return llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmask(self, matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
        """Row i of `bitmask` := the tokens matcher (m, i) allows next (bit t of word t // 32 set: token t is
        allowed)."""
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0][0], bitmask, matchers[0][1])
        else:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, matchers, bitmask)
