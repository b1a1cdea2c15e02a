"""Chat templates rendered in a locked-down Jinja sandbox with time and size limits.

A chat template is code: the model's own, or one a client sends in `chat_template`. transformers renders it
in jinja2's ImmutableSandboxedEnvironment, which stops attribute escapes but not a template that loops for
hours or builds a string of gigabytes. Here the same sandbox also:
- raises SecurityError on any unsafe attribute (`''.__class__`) instead of rendering it as empty,
- caps the size of every `*`, `**`, `+` and `~` result and of the output (`max_chars`),
- stops rendering after `timeout_s` (a trace function on the template's own frames checks the clock).

None of this bounds what Jinja computes while it *compiles* (it folds constant expressions), so a template
sent in a request is accepted only with --trust-request-chat-template and then compiled and rendered in a
child process with a memory limit (chat_template_process.py); the model's own template renders here.

`render` takes the same arguments as `tokenizer.apply_chat_template(..., tokenize=False)` and renders the
same text (continue_final_message cuts after the final message's content, as transformers does).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEMPLATE_FILENAME = "<template>"


class ChatTemplateLimitError(TemplateError):
    """Rendering took too long or produced too much."""


class LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, max_chars: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.max_chars = max_chars
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe.")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    self._check_size(len(seq) * max(times, 0))
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            self._check_size(len(left) + len(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and right * max(abs(left).bit_length(), 1) > 4096:
                raise ChatTemplateLimitError("the chat template computes a number that is too large.")
        return super().call_binop(context, operator, left, right)

    def _check_size(self, size: int) -> None:
        if size > self.max_chars:
            raise ChatTemplateLimitError(f"the chat template builds a value longer than {self.max_chars} items.")


@functools.lru_cache(maxsize=16)
def compile_template(source: str, max_chars: int) -> jinja2.Template:
    env = LimitedSandbox(max_chars)
    template = env.from_string(source)
    namespace = template.root_render_func.__globals__  # the compiled module's globals: checked `~` joins
    for name in ("str_join", "markup_join"):
        if name in namespace:
            namespace[name] = _checked_join(namespace[name], max_chars)
    return template


def _checked_join(join, max_chars: int):
    def checked(seq):
        result = join(seq)
        if len(result) > max_chars:
            raise ChatTemplateLimitError(f"the chat template builds a string longer than {max_chars} characters.")
        return result
    return checked


def render(template_source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
           continue_final_message: bool, special_tokens: dict[str, Any], tools: list | None = None,
           timeout_s: float, max_chars: int, **kwargs: Any) -> str:
    """The prompt text, rendered within timeout_s seconds and max_chars characters (--chat-template-timeout,
    --max-chat-template-chars). Raises jinja2.TemplateError (ChatTemplateLimitError past a limit) or ValueError."""
    template = compile_template(template_source, max_chars)
    tag = "CONTINUE_FINAL_MESSAGE_TAG "
    if continue_final_message:
        messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + tag}]
    variables = {**special_tokens, **kwargs, "messages": messages, "tools": tools, "documents": None,
                 "add_generation_prompt": add_generation_prompt}
    text = _render_limited(template, variables, timeout_s, max_chars)
    if continue_final_message:
        if tag.strip() not in text:
            raise ValueError("continue_final_message is set but the final message does not appear in the "
                             "rendered chat.")
        text = _cut_at_tag(text, tag)
    return text


def load_chat_template(value: str) -> str:
    """The template of --chat-template: a file's text, the value itself when it looks like a template (vLLM's
    rule: it contains `{`, `}` or a newline), or a template shipped in tool_parsers/ by its file name.
    Raises ValueError for a path that cannot be read."""
    for path in (Path(value), Path(__file__).parent / "tool_parsers" / value):
        if path.is_file():
            return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file, nor a template shipped with "
                     "pagedllm (tool_chat_template_hermes.jinja), nor template text.")


def _cut_at_tag(text: str, tag: str) -> str:
    location = text.rindex(tag.strip())
    return text[:location].rstrip() if text[location:location + len(tag)] != tag else text[:location]


def _render_limited(template: jinja2.Template, variables: dict[str, Any], timeout_s: float, max_chars: int) -> str:
    deadline = time.monotonic() + timeout_s

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise ChatTemplateLimitError(f"the chat template took longer than {timeout_s:g} s to render.")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    parts: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        for part in template.generate(**variables):
            size += len(part)
            if size > max_chars:
                raise ChatTemplateLimitError(f"the chat template rendered more than {max_chars} characters.")
            parts.append(part)
    finally:
        sys.settrace(previous)
    return "".join(parts)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise TemplateError(message)
