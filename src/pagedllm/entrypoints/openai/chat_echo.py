"""A chat request's `echo` (vLLM's): the last message's content, put before each choice's content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest


def echo_text(request: ChatCompletionRequest, role: str = "assistant") -> str:
    """What `echo: true` puts before each choice's content (vLLM's): the last message's content when its role is
    the response's `role` (--response-role with add_generation_prompt, else the last message's own), else
    nothing."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""
