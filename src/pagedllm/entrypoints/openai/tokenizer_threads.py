"""TokenizerThreads: the API server's tokenization, off the event loop, in two threads split by size, so that no
single request holds tokenization for everyone.

HF tokenizers release the GIL while they work, so a worker thread keeps the event loop (every other route)
serving; but one thread is a queue, and a big text ahead in it delayed every completion behind it (a 13.8 MB
/tokenize made a two-token completion take 9.99 s instead of 0.04 s). Inputs of at most SMALL_INPUT_CHARS
characters (or token ids) go to the `small` thread and bigger ones to the `big` thread: a big in-cap text (the
request caps bound it to what max_model_len tokens can hold) delays only other big ones, never a small one.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SMALL_INPUT_CHARS = 32_768
"""Texts (or token-id lists) up to this size go to the small thread: the most any small job makes another wait
is the tokenization of ~32 k characters (~10-30 ms on one core), whatever big texts are in flight."""


class TokenizerThreads:
    """Runs tokenizer work (encode, decode, the JSON of a long token list) in one of two worker threads."""

    def __init__(self, small_input_chars: int = SMALL_INPUT_CHARS):
        self.small_input_chars = small_input_chars
        self.small = ThreadPoolExecutor(1, thread_name_prefix="tokenize-small")
        self.big = ThreadPoolExecutor(1, thread_name_prefix="tokenize-big")

    def pool_for(self, size: int) -> ThreadPoolExecutor:
        """The thread for an input of `size` characters (or token ids)."""
        return self.small if size <= self.small_input_chars else self.big

    async def run(self, size: int, fn, *args, **kwargs) -> Any:
        """fn(*args, **kwargs) in the thread for an input of `size`, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool_for(size),
                                                                functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.big.shutdown(wait=False, cancel_futures=True)
