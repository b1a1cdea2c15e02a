"""Streamed chunks written from a template are the bytes pydantic writes for the same response."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai import chat_stream_chunks, serving_completion
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionStreamResponse
from pagedllm.entrypoints.openai.formatting import sse
from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.entrypoints.openai.sse_template import SSETemplate
from pagedllm.outputs import CompletionOutput, RequestOutput

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)  # any scalar: controls, quotes, emoji, U+2028
FINISH = st.sampled_from([None, "stop", "length", "abort"])
STOP = st.one_of(st.none(), st.integers(0, 1 << 20), TEXT)


@given(index=st.integers(0, 300), text=TEXT, finish_reason=FINISH, stop_reason=STOP, request_id=TEXT)
def test_completion_chunk_equals_pydantic(index, text, finish_reason, stop_reason, request_id):
    template = serving_completion._chunk_template(request_id, 1700000000, "Smol/LM \"2\"")
    expected = sse(CompletionStreamResponse(id=request_id, created=1700000000, model="Smol/LM \"2\"", choices=[
        CompletionResponseChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason)]))
    assert template.render(index, text, finish_reason, stop_reason) == expected


@given(index=st.integers(0, 300), content=TEXT, finish_reason=FINISH, stop_reason=STOP)
def test_chat_chunk_equals_pydantic(index, content, finish_reason, stop_reason):
    template = chat_stream_chunks.content_chunk_template("chatcmpl-1", 1700000000, "m")
    choice = chat_stream_chunks.stream_choice((index, content, finish_reason, stop_reason))
    expected = sse(ChatCompletionStreamResponse(id="chatcmpl-1", created=1700000000, model="m", choices=[choice]))
    assert template.render(index, content, finish_reason, stop_reason) == expected


def test_a_hole_missing_from_the_model_is_an_error():
    model = CompletionStreamResponse.model_construct(id="x", created=0, model="m", choices=[])
    with pytest.raises(ValueError, match="'text'"):
        SSETemplate(model, ("text",))


def test_completion_stream_builds_no_pydantic_model_per_token(monkeypatch):
    """The point of the template: a plain stream builds no response model per token (their validators cost more
    API-server CPU than the rest of the stream path), and its bytes are still pydantic's."""
    built = []
    for cls in (CompletionStreamResponse, CompletionResponseChoice):
        original = cls.__init__

        def counting(self, *args, __original=original, **kwargs):
            built.append(type(self).__name__)
            __original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    serving = object.__new__(serving_completion.OpenAIServingCompletion)
    serving.served_model_names = ["m"]
    serving.models = ServingModels(["m"], "/models/m")
    serving.config = ServerConfig()
    texts = [" a", "\u00e9\n", " \"b\"", ""]
    outputs = [RequestOutput("cmpl-1", None, [1, 2], [CompletionOutput(0, text, [5 + i],
                                                                       finish_reason="length" if i == 3 else None)],
                             finished=i == 3) for i, text in enumerate(texts)]

    async def merged():
        for output in outputs:
            yield 0, output

    async def collect():
        request = CompletionRequest(model="m", prompt="hi", stream=True)
        return [chunk async for chunk in serving._stream(request, "cmpl-1", [("hi", [1, 2])], merged())]

    chunks = asyncio.run(collect())
    assert built == []
    monkeypatch.undo()
    created = json.loads(chunks[0][len("data: "):])["created"]
    assert chunks == [sse(CompletionStreamResponse(id="cmpl-1", created=created, model="m", choices=[
        CompletionResponseChoice(index=0, text=text, finish_reason="length" if i == 3 else None)]))
        for i, text in enumerate(texts)] + ["data: [DONE]\n\n"]
