"""The in-memory store of /v1/responses (`store: true`, OpenAI's default): each stored response with the messages
of its conversation so far, for `previous_response_id` and GET /v1/responses/{id}. Bounded: beyond
--max-stored-responses the least recently used response is dropped, and its id then answers 404 as an unknown one
does (OpenAI's and vLLM's error). Lives in the API server process; a restart forgets everything."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.responses_protocol import ResponsesResponse


@dataclass
class StoredResponse:
    response: ResponsesResponse
    messages: list[dict[str, Any]]
    """The conversation up to and including this response's output, without instructions (OpenAI does not carry
    a response's instructions into the next turn)."""


class ResponseStore:
    def __init__(self, max_size: int):
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response (now the most recently used); APIError(404) for an unknown or dropped id."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise errors.APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                                  param="response_id")
        self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)
