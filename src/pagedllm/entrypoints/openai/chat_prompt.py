"""A chat request's messages rendered into prompt text: one path for POST /v1/chat/completions and POST /tokenize
(with messages), so that both honour, or refuse, the same fields alike: chat_template (refused, as vLLM does, unless
--trust-request-chat-template), chat_template_kwargs, add_generation_prompt, continue_final_message and the tools
the template sees.

The model's own template renders in this process, in the limited sandbox of chat_template.py; a request's template
renders in the child process of chat_template_process.py (memory-limited, killable)."""

from __future__ import annotations

from typing import Any, Protocol

from pagedllm.config import ServerConfig
from pagedllm.engine.input_processor import is_valid_unicode
from pagedllm.entrypoints.openai import chat_template as chat_template_module
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.chat_template_process import ChatTemplateProcess, ChatTemplateProcessError

MAX_REQUEST_CHAT_TEMPLATE_CHARS = 100_000
"""Longest chat template a request may send (with --trust-request-chat-template); models' own are ~1-20 kB."""


class ChatPromptFields(Protocol):
    """The request fields that make a chat prompt (ChatCompletionRequest's and TokenizeRequest's)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None


class ChatPrompts:
    """Renders requests' messages into prompt text (`render`); one per app, shared by the routes that render."""

    def __init__(self, tokenizer, config: ServerConfig):
        self.tokenizer = tokenizer
        self.config = config
        self.template_process = ChatTemplateProcess()
        """Renders request-supplied templates (with --trust-request-chat-template); started on first use."""

    async def render(self, request: ChatPromptFields, template_tools: list[dict[str, Any]] | None) -> str:
        """The prompt text of `request`'s messages; template_tools: the tools as the template sees them (OpenAI's
        `{"type": "function", "function": {...}}`), None for none. Raises APIError(400) as vLLM refuses."""
        template = request_chat_template(request, self.config.trust_request_chat_template)
        render_args = (self.tokenizer, request.messages, request.add_generation_prompt,
                       request.continue_final_message, template, request.chat_template_kwargs, template_tools,
                       self.config.chat_template_timeout, self.config.max_chat_template_chars)
        if template is None:
            return render_chat(*render_args)
        return await render_request_template(self.template_process, *render_args)


def request_chat_template(request: ChatPromptFields, trusted: bool) -> str | None:
    """The template the request sends, in chat_template or in chat_template_kwargs["chat_template"] (None: the
    model's own). Refused (400), as vLLM does, unless the server trusts request templates."""
    from_kwargs = (request.chat_template_kwargs or {}).get("chat_template")
    source = request.chat_template if request.chat_template is not None else from_kwargs
    if source is None:
        return None
    if not trusted:
        raise errors.bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                                 "set. Refused request with untrusted chat template.", param="chat_template")
    if not isinstance(source, str) or len(source) > MAX_REQUEST_CHAT_TEMPLATE_CHARS:
        raise errors.bad_request(f"chat_template must be a string of at most {MAX_REQUEST_CHAT_TEMPLATE_CHARS} "
                                 "characters.", param="chat_template")
    return source


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, chat_template: str | None, chat_template_kwargs: dict[str, Any] | None,
                tools: list | None, timeout_s: float, max_chars: int) -> str:
    """The prompt text for a conversation, rendered in the limited sandbox of chat_template.py (in this
    process: for the model's own template; a request's goes through ChatTemplateProcess).

    Raises APIError(400) for messages or a template that cannot render, or that break a limit."""
    source, conversation, kwargs = _render_inputs(tokenizer, messages, add_generation_prompt, continue_final_message,
                                                  chat_template, chat_template_kwargs)
    try:
        text = chat_template_module.render(source, conversation, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           special_tokens=tokenizer.special_tokens_map, tools=tools,
                                           timeout_s=timeout_s, max_chars=max_chars, **kwargs)
    except Exception as e:  # jinja2 TemplateError (SecurityError, limits), ValueError, TypeError, ...
        raise _render_error(f"{type(e).__name__}: {e}") from None
    return _checked_text(text)


async def render_request_template(process: ChatTemplateProcess, tokenizer, messages: list[dict[str, Any]],
                                  add_generation_prompt: bool, continue_final_message: bool, chat_template: str,
                                  chat_template_kwargs: dict[str, Any] | None, tools: list | None, timeout_s: float,
                                  max_chars: int) -> str:
    """render_chat of a request-supplied template, in the child process of chat_template_process.py (the
    event loop serves other requests meanwhile)."""
    source, conversation, kwargs = _render_inputs(tokenizer, messages, add_generation_prompt, continue_final_message,
                                                  chat_template, chat_template_kwargs)
    try:
        text = await process.render(source, conversation, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    special_tokens=tokenizer.special_tokens_map, tools=tools, timeout_s=timeout_s,
                                    max_chars=max_chars, **kwargs)
    except ChatTemplateProcessError as e:
        raise _render_error(str(e)) from None
    return _checked_text(text)


def _render_error(reason: str) -> errors.APIError:
    return errors.bad_request(f"The chat template could not render these messages: {reason}", param="messages")


def _checked_text(text: str) -> str:
    if not is_valid_unicode(text):
        raise errors.bad_request("messages must be valid Unicode (no lone surrogates).", param="messages")
    return text


def _render_inputs(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   continue_final_message: bool, chat_template: str | None,
                   chat_template_kwargs: dict[str, Any] | None) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(template source, normalized messages, extra template variables); raises APIError(400)."""
    if add_generation_prompt and continue_final_message:
        raise errors.bad_request("add_generation_prompt and continue_final_message cannot both be true.",
                                 param="continue_final_message")
    if not messages:
        raise errors.bad_request("messages must not be empty.", param="messages")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise errors.bad_request("continue_final_message needs an assistant message last.",
                                 param="continue_final_message")
    conversation = [_normalize_message(m, i) for i, m in enumerate(messages)]
    source = chat_template if chat_template is not None else tokenizer.chat_template
    if not isinstance(source, str):
        raise errors.bad_request("The model has no chat template; send one in chat_template (the server needs "
                                 "--trust-request-chat-template).", param="chat_template")
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items()
              if k not in ("messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template")}
    return source, conversation, kwargs


def _normalize_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str):
        raise errors.bad_request(f"messages[{index}] has no role.", param="messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise errors.bad_request(f"messages[{index}]: only text content parts are supported.",
                                         param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise errors.bad_request(f"messages[{index}].content must be a string or a list of parts.",
                                 param="messages")
    return {**message, "role": role, "content": content}
