"""The chunks of a chat stream whose choice carries content only: written from an SSE template (most chunks of a
plain stream), or built from the (index, content, finish_reason, stop_reason) tuple the stream collects."""

from __future__ import annotations

from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.sse_template import SSETemplate

_HOLES = ("index", "content", "finish_reason", "stop_reason")


def content_chunk_template(request_id: str, created: int, model_name: str) -> SSETemplate:
    """A stream chunk with one choice whose delta is content only."""
    marker = SSETemplate.marker
    choice = ChatCompletionStreamChoice.model_construct(
        index=marker("index"), delta=DeltaMessage.model_construct(content=marker("content")),
        finish_reason=marker("finish_reason"), stop_reason=marker("stop_reason"))
    return SSETemplate(ChatCompletionStreamResponse.model_construct(id=request_id, created=created, model=model_name,
                                                                    choices=[choice]), _HOLES)


def stream_choice(choice: ChatCompletionStreamChoice | tuple) -> ChatCompletionStreamChoice:
    if isinstance(choice, tuple):
        index, content, finish_reason, stop_reason = choice
        return ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=content),
                                          finish_reason=finish_reason, stop_reason=stop_reason)
    return choice
