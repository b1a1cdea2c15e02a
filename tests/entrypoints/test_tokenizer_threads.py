"""No single request holds tokenization for everyone: while a big text is being tokenized (here: held until the
test lets it go), a small one, from any route, is tokenized at once. With one tokenizer thread, a 13.8 MB /tokenize
made a two-token completion wait 9.99 s."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.entrypoints.openai.tokenizer_threads import SMALL_INPUT_CHARS, TokenizerThreads

BIG = "x" * (SMALL_INPUT_CHARS + 1)


class HeldTokenizer:
    """Encodes a text as one id per character; a text over SMALL_INPUT_CHARS waits until `release` is set."""

    def __init__(self):
        self.big_started = threading.Event()
        self.release = threading.Event()

    def get_vocab(self) -> dict[str, int]:
        return {"x" * 64: 0}  # one long token: a big cap, so that BIG is in it

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > SMALL_INPUT_CHARS:
            self.big_started.set()
            assert self.release.wait(60), "never released"
        return [0] * len(text)


def _serving(tokenizer, threads: TokenizerThreads) -> OpenAIServing:
    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=4096)
    return OpenAIServing(engine, ["m"], tokenizer_threads=threads)


def test_small_texts_pass_a_big_one_in_every_route():
    async def main():
        tokenizer = HeldTokenizer()
        threads = TokenizerThreads()
        completions, chat = _serving(tokenizer, threads), _serving(tokenizer, threads)  # one app's routes
        big = asyncio.create_task(completions.encode(BIG, True))
        assert await asyncio.to_thread(tokenizer.big_started.wait, 60)
        try:
            # each bounded by a hang guard only: with one thread they would wait for the big text forever
            assert await asyncio.wait_for(completions.encode("hello", True), 60) == [0] * 5
            assert await asyncio.wait_for(chat.encode("hi", True), 60) == [0] * 2
            assert await asyncio.wait_for(threads.run(2, len, "ab"), 60) == 2
            assert not big.done()  # the small ones went past it
        finally:
            tokenizer.release.set()
        assert len(await asyncio.wait_for(big, 60)) == len(BIG)
        threads.shutdown()

    asyncio.run(main())


def test_inputs_are_split_by_size():
    threads = TokenizerThreads(small_input_chars=10)
    assert threads.pool_for(0) is threads.small and threads.pool_for(10) is threads.small
    assert threads.pool_for(11) is threads.big
    threads.shutdown()


def test_text_over_the_cap_is_refused_before_tokenizing():
    tokenizer = HeldTokenizer()
    serving = _serving(tokenizer, TokenizerThreads())
    with pytest.raises(APIError, match="maximum context length is 4096 tokens") as info:
        asyncio.run(serving.encode("x" * (serving.max_prompt_chars + 1), True))
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    assert not tokenizer.big_started.is_set()
