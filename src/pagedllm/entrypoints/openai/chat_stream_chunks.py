"""The chunks of a chat stream whose choice carries content only: written from an SSE template (most chunks of a
plain stream), or built from the (index, content, finish_reason, stop_reason) tuple the stream collects; and the
delta of a choice whose output is parsed (tool calls, reasoning)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningStream
from pagedllm.entrypoints.openai.sse_template import SSETemplate
from pagedllm.entrypoints.openai.tool_calling import ChoiceStream, ToolCalling

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


def choice_delta(text: str, finish_reason: str | None, tools: ToolCalling, calls: ChoiceStream,
                 thoughts: ReasoningStream | None) -> tuple[DeltaMessage | None, str | None]:
    """The delta of one choice's new text (None: nothing to send yet: a tail that may begin a tool call or a
    reasoning tag) and the finish_reason to send with it. The reasoning (with --reasoning-parser) goes to
    `reasoning` and `reasoning_content`; tool calls are read from the content after it."""
    thought = ""
    if thoughts is not None:
        thought, text = thoughts.feed(text, finish_reason is not None)
    delta: DeltaMessage | None = DeltaMessage(content=text)
    if tools.parses_output:
        delta, finish_reason = calls.delta(text, finish_reason)
    elif thoughts is not None and not text:
        delta = DeltaMessage() if finish_reason is not None else None
    if thought:
        delta = delta or DeltaMessage()
        delta.reasoning = delta.reasoning_content = thought
    return delta, finish_reason
