"""The events of a streamed response (`stream: true` on POST /v1/responses), OpenAI's sequence, which the `openai`
SDK's `responses.stream()` accumulates: response.created, response.in_progress, then per output item
response.output_item.added, its parts and deltas (response.content_part.added, response.output_text.delta ...,
response.output_text.done, response.content_part.done; response.reasoning_text.delta/.done for a reasoning item;
response.function_call_arguments.delta/.done for a function call), response.output_item.done, and finally
response.completed with the whole response. Every event carries its sequence_number. The items are built here as
they stream, so the final response holds the very items (and ids) the events announced."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)
from pagedllm.entrypoints.openai.tool_protocol import DeltaToolCall


class EventWriter:
    """SSE frames `event: TYPE` / `data: {...}`, numbered in order."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, type: str, **fields: Any) -> str:
        body = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def _dump(item) -> dict[str, Any]:
    return item.model_dump(mode="json")


class StreamedItems:
    """The output items of one streamed response: reasoning, content and tool-call deltas in, events out."""

    def __init__(self, event: EventWriter):
        self.event = event
        self.output: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.text = ""
        self.calls: dict[int, FunctionCallItem] = {}
        """Streamed tool call index -> its item."""

    @property
    def index(self) -> int:
        return len(self.output) - 1

    def reasoning(self, delta: str) -> list[str]:
        events = []
        if not isinstance(self.open, ReasoningItem):
            events = self.close() + self._add(ReasoningItem(status="in_progress"))
            events.append(self._part_event("response.content_part.added", ReasoningText(text="")))
        self.text += delta
        return events + [self.event("response.reasoning_text.delta", item_id=self.open.id, output_index=self.index,
                                    content_index=0, delta=delta)]

    def content(self, delta: str) -> list[str]:
        events = []
        if not isinstance(self.open, OutputMessage):
            events = self.close() + self._add(OutputMessage(status="in_progress"))
            events.append(self._part_event("response.content_part.added", OutputText(text="")))
        self.text += delta
        return events + [self.event("response.output_text.delta", item_id=self.open.id, output_index=self.index,
                                    content_index=0, delta=delta, logprobs=[])]

    def tool_calls(self, deltas: list[DeltaToolCall]) -> list[str]:
        events = []
        for delta in deltas:
            call = self.calls.get(delta.index)
            if call is None:
                events += self.close()
                call = self.calls[delta.index] = FunctionCallItem(call_id=delta.id, name=delta.function.name,
                                                                  arguments="", status="in_progress")
                events += self._add(call)
            arguments = delta.function.arguments if delta.function is not None else None
            if arguments:
                call.arguments += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=call.id,
                                         output_index=self.output.index(call), delta=arguments))
        return events

    def finish(self) -> list[str]:
        """Close the open item; a response with neither content nor calls gets an empty message, as when not
        streamed."""
        if not any(isinstance(item, (OutputMessage, FunctionCallItem)) for item in self.output):
            return self.close() + self._add(OutputMessage(status="in_progress")) + [
                self._part_event("response.content_part.added", OutputText(text=""))] + self.close()
        return self.close()

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item.status = "completed"
        if isinstance(item, FunctionCallItem):
            return [self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                               name=item.name, arguments=item.arguments),
                    self.event("response.output_item.done", output_index=index, item=_dump(item))]
        text, self.text = self.text, ""
        if isinstance(item, ReasoningItem):
            part = ReasoningText(text=text)
            done = self.event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                              text=text)
        else:
            part = OutputText(text=text)
            done = self.event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                              text=text, logprobs=[])
        item.content = [part]
        return [done, self._part_event("response.content_part.done", part, item, index),
                self.event("response.output_item.done", output_index=index, item=_dump(item))]

    def _add(self, item: OutputItem) -> list[str]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=self.index, item=_dump(item))]

    def _part_event(self, type: str, part, item=None, index: int | None = None) -> str:
        item = item if item is not None else self.open
        return self.event(type, item_id=item.id, output_index=self.index if index is None else index,
                          content_index=0, part=_dump(part))
