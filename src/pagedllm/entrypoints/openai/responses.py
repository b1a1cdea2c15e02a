"""How a generation route answers: the handler raced against the client's disconnect, its exceptions mapped to
API errors, and its result sent as JSON or as an SSE stream that is always closed."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai import errors


async def run_until_disconnect(request: Request, coro):
    """Await coro, cancelling it if the client disconnects first (cancellation aborts the request)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        return None
    return task.result()


async def guard(coro):
    """Turn an exception raised while serving into its APIError, so the handler never 500s a bad request."""
    try:
        return await coro
    except errors.APIError:
        raise
    except Exception as e:
        raise errors.to_api_error(e) from e


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator. When the client goes away while a write is
    blocked, Starlette cancels the response inside `send()` and leaves the SSE generator suspended at its
    `yield`, never closed: its `finally` (which aborts the request in the engine) would not run and the engine
    would generate to max_tokens for nobody."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def respond(result) -> Response:
    if result is None:  # the client went away
        return Response(status_code=499)
    if hasattr(result, "__aiter__"):
        return ClosingStreamingResponse(result, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    # pydantic writes the JSON: a non-finite float becomes null instead of failing the response
    return Response(result.model_dump_json(), media_type="application/json")
