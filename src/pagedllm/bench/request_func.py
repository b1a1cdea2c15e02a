"""One streaming request to an OpenAI-compatible server, timed the way `vllm bench serve` times it.

TTFT is the time from sending the request to the first server-sent event that carries a choice; each later
choice event adds one inter-token latency (ITL), the gap since the previous one; the latency (E2EL) ends at
the last choice event. The usage event supplies the server's own token counts, whether it comes alone
(`"choices": []`, vLLM) or beside the last choice (llama.cpp: a choice of empty text with the finish_reason,
which is not counted as a token event; vLLM's client skips such a usage and re-tokenizes the text instead).
"""

from __future__ import annotations

import codecs
import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pagedllm import envs


@dataclass
class RequestFuncInput:
    prompt: str | list[int]
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: str | None = None
    logprobs: int | None = None
    extra_body: dict | None = None
    ignore_eos: bool = False
    request_id: str | None = None


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    tpot: float = 0.0
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    # Seconds the request waited for a --max-concurrency slot before it was sent.
    client_queue_time: float = 0.0
    # Times the request was sent again because the server closed the connection before taking it.
    retries: int = 0
    # usage.prompt_tokens_details.cached_tokens (prompt tokens served from a cache: the server's prefix cache or a
    # KV connector's tier); None when the server does not report it (vLLM: without --enable-prompt-tokens-details).
    cached_tokens: int | None = None


class SSEParser:
    """Splits a byte stream into server-sent-event payloads ("data: ..."), across chunk boundaries."""

    def __init__(self) -> None:
        self._buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk: bytes) -> list[str]:
        """Return the payloads of the events completed by `chunk`, without the "data: " prefix.
        SSE comments (lines starting with ":", used as keep-alive pings) are dropped."""
        self._buffer += self._decoder.decode(chunk)
        events = []
        while "\n\n" in self._buffer:
            event, self._buffer = self._buffer.split("\n\n", 1)
            events.append(event)
        payloads = []
        for event in events:
            # SSE lines end only at CR or LF: str.splitlines() and strip() would also cut at U+2028, U+0085 and
            # the like, which a JSON string may hold raw (a sampled token's text did: "Unterminated string").
            for line in event.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
                if line.startswith("data:"):
                    payloads.append(line[len("data:"):].removeprefix(" "))
        return payloads


def _headers(request_id: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key := envs.OPENAI_API_KEY:
        headers["Authorization"] = f"Bearer {api_key}"
    if request_id:
        headers["x-request-id"] = request_id
    return headers


def completions_payload(inp: RequestFuncInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": inp.model_name or inp.model,
        "prompt": inp.prompt,
        "repetition_penalty": 1.0,
        "max_tokens": inp.output_len,
        "logprobs": inp.logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _with_common(payload, inp)


def chat_payload(inp: RequestFuncInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": inp.model_name or inp.model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": inp.prompt}]}],
        "max_completion_tokens": inp.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _with_common(payload, inp)


def _with_common(payload: dict[str, Any], inp: RequestFuncInput) -> dict[str, Any]:
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.extra_body:
        payload.update(inp.extra_body)
    return payload


def _completion_text(choice: dict) -> str | None:
    return choice.get("text")


def _chat_text(choice: dict) -> str | None:
    return (choice.get("delta") or {}).get("content")


async def _stream(
    inp: RequestFuncInput,
    session: aiohttp.ClientSession,
    payload: dict[str, Any],
    choice_text: Callable[[dict], str | None],
    pbar=None,
) -> RequestFuncOutput:
    output = RequestFuncOutput(prompt_len=inp.prompt_len)
    text_parts: list[str] = []
    start = time.perf_counter()
    output.start_time = start
    last_token_time = start
    try:
        response = await _post(session, inp, payload, output)
        async with response:
            if response.status != 200:
                body = await response.text()
                output.error = f"HTTP {response.status} {response.reason or ''}: {body[:500]}".strip()
            else:
                parser = SSEParser()
                first_token_seen = False
                async for chunk in response.content.iter_any():
                    for data in parser.feed(chunk):
                        if data == "[DONE]":
                            continue
                        message = json.loads(data)
                        usage = message.get("usage")
                        choices = message.get("choices")
                        text = choice_text(choices[0]) if choices else None
                        # A choice chunk is a token event, except a closing chunk that carries the usage beside
                        # a choice of empty text (llama.cpp ends a stream so).
                        if choices and (text or not usage):
                            now = time.perf_counter()
                            if not first_token_seen:
                                first_token_seen = True
                                output.ttft = now - start
                            else:
                                output.itl.append(now - last_token_time)
                            last_token_time = now
                            text_parts.append(text or "")
                        if usage:
                            output.output_tokens = usage.get("completion_tokens") or 0
                            if (prompt_tokens := usage.get("prompt_tokens")) is not None:
                                output.prompt_len = prompt_tokens
                            if (details := usage.get("prompt_tokens_details")) is not None:
                                output.cached_tokens = details.get("cached_tokens")
                output.generated_text = "".join(text_parts)
                output.latency = last_token_time - start
                output.success = first_token_seen
                if not first_token_seen:
                    output.error = "Never received a valid chunk to calculate TTFT."
    except Exception:
        output.success = False
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    if pbar is not None:
        pbar.update(1)
    return output


async def _post(session: aiohttp.ClientSession, inp: RequestFuncInput, payload: dict[str, Any],
                output: RequestFuncOutput) -> aiohttp.ClientResponse:
    """Send the request. A connection the server closes before it has taken the request (a stale keep-alive
    connection, or llama-server dropping one of a burst of new connections: about 1 in 50 on a fresh server) is
    retried once on a new connection, as the OpenAI SDK retries connection errors; the timing keeps counting from
    the first attempt, and `output.retries` records it. That includes a pooled keep-alive connection the server
    closed as the request was being written (aiohttp's ClientOSError "Can not write request body": llama-server
    ends a connection after a few requests, and 7 of 64 requests at concurrency 16 were lost to it)."""
    for attempt in range(2):
        try:
            return await session.post(inp.api_url, json=payload, headers=_headers(inp.request_id))
        except (aiohttp.ClientConnectionResetError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if attempt:
                raise
            output.retries += 1
    raise AssertionError("unreachable")


async def request_openai_completions(inp: RequestFuncInput, session: aiohttp.ClientSession,
                                     pbar=None) -> RequestFuncOutput:
    """POST a streaming /v1/completions request and time it."""
    return await _stream(inp, session, completions_payload(inp), _completion_text, pbar)


async def request_openai_chat(inp: RequestFuncInput, session: aiohttp.ClientSession,
                              pbar=None) -> RequestFuncOutput:
    """POST a streaming /v1/chat/completions request and time it."""
    return await _stream(inp, session, chat_payload(inp), _chat_text, pbar)


RequestFunc = Callable[..., Awaitable[RequestFuncOutput]]

# --backend -> request function
REQUEST_FUNCS: dict[str, RequestFunc] = {
    "vllm": request_openai_completions,
    "openai": request_openai_completions,
    "openai-chat": request_openai_chat,
}
