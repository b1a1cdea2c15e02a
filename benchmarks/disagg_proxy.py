"""A small disaggregated prefill/decode proxy, as in vLLM's examples (the toy proxy of its NixlConnector tests):
one OpenAI-compatible endpoint in front of prefill servers (`kv_role` kv_producer or kv_both) and decode servers
(kv_consumer or kv_both), speaking vLLM's `kv_transfer_params` protocol. Needs only aiohttp (a pagedllm
dependency), so it runs beside any vLLM-compatible pair, pagedllm's or vLLM's.

    python benchmarks/disagg_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

For each POST /v1/completions or /v1/chat/completions:
1. the prefill request: the client's body with `stream` false, `max_tokens` (and `max_completion_tokens` when
   given) 1, no `stream_options` nor `min_tokens`, and `kv_transfer_params` {"do_remote_decode": true, ...};
   sent to the next prefill server (round robin) with an `X-Request-Id` that the decode request shares;
2. the decode request: the client's own body, plus the `kv_transfer_params` of the prefill response
   (do_remote_prefill, remote_block_ids, remote_engine_id, remote_host, remote_port, ...), sent to the next
   decode server; its answer (a stream or one JSON body) goes back to the client as it comes.
A prefill answer other than 200 goes back to the client as it is (the decode server is not asked). A prefill
answer without `kv_transfer_params` sends the decode request without them: the decode server then computes the
prompt itself. GET /health is 200 when every server's /health is; GET /v1/models is the first decode server's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import uuid

import aiohttp
from aiohttp import web

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What the prefill request carries: the prefill server keeps the prompt's blocks for a decode server to pull."""


def prefill_body(body: dict) -> dict:
    """The prefill request's body for the client's `body` (step 1 above)."""
    body = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(name, None)
    return body


def decode_body(body: dict, prefill_answer: dict) -> dict:
    """The decode request's body: the client's, with the prefill answer's kv_transfer_params (step 2 above)."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str]):
        self.prefill, self.decode = prefill, decode
        self._next_prefill = itertools.cycle(prefill)
        self._next_decode = itertools.cycle(decode)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def stop(self, _app: web.Application) -> None:
        await self.session.close()

    @staticmethod
    def _headers(request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"error": {"message": f"invalid JSON body: {e}", "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the body must be a JSON object",
                                                "type": "BadRequestError", "param": None, "code": 400}}, status=400)
        path = request.path
        request_id = request.headers.get("X-Request-Id") or f"disagg-{uuid.uuid4().hex}"
        headers = self._headers(request, request_id)
        async with self.session.post(next(self._next_prefill) + path, json=prefill_body(body),
                                     headers=headers) as answer:
            raw = await answer.read()
            if answer.status != 200:
                return web.Response(body=raw, status=answer.status, content_type=answer.content_type)
        async with self.session.post(next(self._next_decode) + path, json=decode_body(body, json.loads(raw)),
                                     headers=headers) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            response.headers["X-Request-Id"] = request_id
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(self, _request: web.Request) -> web.Response:
        async def one(url: str) -> bool:
            try:
                async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as answer:
                    return answer.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return False

        healthy = await asyncio.gather(*(one(url) for url in self.prefill + self.decode))
        return web.Response(status=200 if all(healthy) else 503)

    async def models(self, _request: web.Request) -> web.Response:
        async with self.session.get(self.decode[0] + "/v1/models") as answer:
            return web.Response(body=await answer.read(), status=answer.status, content_type=answer.content_type)


def build_app(prefill: list[str], decode: list[str]) -> web.Application:
    proxy = Proxy([u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode])
    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.generate)
    app.router.add_post("/v1/chat/completions", proxy.generate)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, help="A prefill server's URL (repeatable).")
    parser.add_argument("--decode", action="append", required=True, help="A decode server's URL (repeatable).")
    args = parser.parse_args()
    web.run_app(build_app(args.prefill, args.decode), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
