"""A stand-in OpenAI-compatible server that streams `max_tokens` words at a fixed pace.

Used by the client tests (in a thread, see `running_fake_server`) and, as a script, to drive vLLM's own
client for a side-by-side check of the result files: `python tests/bench/fake_openai_server.py PORT [--llamacpp]`.
Requests whose prompt contains "FAIL" get HTTP 500; the first one whose prompt contains "DROP" has its connection
closed without an answer (what llama-server does now and then to a new connection).
Every request is recorded in `app[REQUESTS]`.

The usage event ends the stream as vLLM's server sends it, `{"choices": [], "usage": ...}`; with
`llamacpp=True` a completions stream ends as llama.cpp's server ends it instead: one last chunk with a choice of
empty text and its finish_reason, and `usage` beside it; and it has llama.cpp's `/tokenize`, which reads the text
from "content" and answers `{"tokens": []}` to vLLM's `{"prompt": ...}` (calls counted in `app[TOKENIZE_CALLS]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time

from aiohttp import web

TOKEN_DELAY_S = 0.002
MODEL = "fake-model"
REQUESTS = web.AppKey("requests", list)
LLAMACPP = web.AppKey("llamacpp", bool)
TOKENIZE_CALLS = web.AppKey("tokenize_calls", list)
DROPPED = web.AppKey("dropped", list)


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL}]})


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def _tokenize(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[TOKENIZE_CALLS].append(body)
    return web.json_response({"tokens": list(range(len(str(body["content"]).split()))) if "content" in body else []})


async def _stream(request: web.Request, chat: bool) -> web.StreamResponse:
    body = await request.json()
    request.app[REQUESTS].append({"body": body, "headers": {k.lower(): v for k, v in request.headers.items()}})
    prompt = json.dumps(body.get("messages")) if chat else str(body.get("prompt"))
    if "FAIL" in prompt:
        return web.Response(status=500, reason="Internal Server Error", text="asked to fail")
    if "DROP" in prompt and not request.app[DROPPED]:
        request.app[DROPPED].append(prompt)
        request.transport.close()
        raise asyncio.CancelledError
    num_tokens = body.get("max_completion_tokens") if chat else body.get("max_tokens")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(num_tokens or 16):
        await asyncio.sleep(TOKEN_DELAY_S)
        choice = {"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "}
        # A keep-alive comment rides with the first event (vLLM's client drops a comment sent alone).
        ping = ": ping\n\n" if i == 0 else ""
        await response.write(f"{ping}data: {json.dumps({'choices': [choice]})}\n\n".encode())
    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": num_tokens or 16}
    if "CACHED" in prompt:  # vLLM with --enable-prompt-tokens-details
        usage["prompt_tokens_details"] = {"cached_tokens": 1}
    choices = []
    if request.app[LLAMACPP] and not chat:
        choices = [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    await response.write(f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
    return response


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _stream(request, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _stream(request, chat=True)


def make_app(llamacpp: bool = False) -> web.Application:
    app = web.Application()
    app[REQUESTS] = []
    app[LLAMACPP] = llamacpp
    app[TOKENIZE_CALLS] = []
    app[DROPPED] = []
    if llamacpp:
        app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_fake_server(llamacpp: bool = False):
    """Serve the fake app on a free port in a background thread; yields (base_url, app)."""
    app, port = make_app(llamacpp), free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        time.sleep(0)


if __name__ == "__main__":
    web.run_app(make_app(llamacpp="--llamacpp" in sys.argv[2:]), host="127.0.0.1", port=int(sys.argv[1]))
