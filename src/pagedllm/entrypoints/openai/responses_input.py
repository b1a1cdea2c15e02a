"""A Responses request's input as chat messages (the model's chat template renders them, as for
/v1/chat/completions): a text is one user message; a list holds items, each turned into a message or merged into
one, and every key of an item is used or refused (a 400 naming `input[i].key`):

- a message, `{"type": "message"?, "role", "content"}` (role system, developer, user or assistant; content a text,
  or a list of `input_text` / `output_text` / `text` parts); `id` and `status` (earlier output) are accepted;
- `{"type": "function_call", "call_id", "name", "arguments"}`: an assistant message's tool call (consecutive calls
  are one assistant message, as chat templates expect);
- `{"type": "function_call_output", "call_id", "output"}`: a `tool` message answering that call;
- `{"type": "reasoning", "content" or "summary"}`: earlier reasoning, as the next assistant message's
  `reasoning_content` (which reasoning models' templates read, and most drop from earlier turns).

And the output of a stored response as the assistant's messages of the next turn (`previous_response_id`)."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.responses_protocol import FunctionCallItem, OutputItem, OutputMessage, ReasoningItem

_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_ITEM_KEYS = {
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "status", "encrypted_content"},
}
_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`; raises APIError(400) naming the item's key it cannot honour."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item waiting for its assistant message
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        keys = _MESSAGE_KEYS if kind == "message" else _ITEM_KEYS.get(kind)
        if keys is None:
            raise errors.bad_request(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                                     "function_call_output and reasoning are).", param=f"input[{i}].type")
        extra = sorted(set(item) - keys)
        if extra:
            raise errors.bad_request(f"input[{i}]: unknown field {extra[0]!r}.", param=f"input[{i}].{extra[0]}")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise errors.bad_request(f"input[{i}].role must be one of {', '.join(_ROLES)}.",
                                         param=f"input[{i}].role")
            message = {"role": role, "content": _text(item.get("content"), f"input[{i}].content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"input[{i}].content")
    return messages


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the assistant messages the next turn's template sees."""
    messages: list[dict[str, Any]] = []
    reasoning = None
    for item in output:
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content)
            continue
        if isinstance(item, OutputMessage):
            message = {"role": "assistant", "content": "".join(part.text for part in item.content)}
        else:
            assert isinstance(item, FunctionCallItem)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
    if reasoning is not None:
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    return messages


def _string(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise errors.bad_request(f"input[{index}].{key} must be a string.", param=f"input[{index}].{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A text, or the text of a list of text parts (an image or a file is a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.bad_request(f"{param} must be a string or a list of text parts.", param=param)
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else None
            raise errors.bad_request(f"{param}[{j}]: only text parts are supported, not {kind!r}.",
                                     param=f"{param}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)
