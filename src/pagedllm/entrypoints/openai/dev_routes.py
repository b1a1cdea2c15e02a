"""vLLM's development routes, served in development mode: VLLM_SERVER_DEV_MODE=1 (vLLM's switch) or
--enable-debug-routes (pagedllm's).

    POST /reset_prefix_cache   {"success": bool}: forget every cached prefix, on every data-parallel replica;
                               false while a request holds blocks (retry when idle), as vLLM's.
    POST /sleep?level=0|1|2    {"status": "sleeping", "level": L}: abort the open requests and pause; at 1 and
                               2 also drop the weights and the KV pool (needs --enable-sleep-mode;
                               engine/sleep_mode.py). Requests that arrive meanwhile wait for /wake_up.
    POST /wake_up[?tags=...]   {"status": "awake" | "sleeping", "tags": [...] | null}: tags weights, kv_cache,
                               scheduling (repeated: ?tags=weights&tags=kv_cache); none: everything.
    GET /is_sleeping           {"is_sleeping": bool}

Like every route but /health, /ping and /metrics they need the API key when the server has one (middleware.py);
vLLM's key guards only /v1 paths.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from pagedllm import envs
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.server_state import ServerState

logger = logging.getLogger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode(enable_debug_routes: bool) -> bool:
    """Whether the development routes are served: --enable-debug-routes, or VLLM_SERVER_DEV_MODE set to 1 (vLLM
    reads it as an integer; "true" is taken too)."""
    return enable_debug_routes or envs.VLLM_SERVER_DEV_MODE


def add_dev_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine
    logger.warning("Development routes are on (/reset_prefix_cache, /sleep, /wake_up, /is_sleeping): not for "
                   "production.")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        """reset_external: there is no external (connector) prefix cache here, so nothing more to reset (vLLM
        answers the same without a connector)."""
        if reset_running_requests:
            raise errors.bad_request("reset_running_requests=true (preempting the running requests to reset the "
                                     "cache under them) is not supported; reset when the server is idle.",
                                     param="reset_running_requests")
        logger.info("Resetting the prefix cache")
        return JSONResponse({"success": bool(await engine.reset_prefix_cache())})

    @app.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1, mode: str = "abort"):
        if mode != "abort":
            raise errors.bad_request(f"sleep mode {mode!r} is not supported: only 'abort' (the default: the open "
                                     "requests are aborted).", param="mode")
        try:
            await engine.sleep(level)
        except ValueError as e:
            raise errors.bad_request(str(e), param="level") from None
        return JSONResponse({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(request: Request):
        tags = request.query_params.getlist("tags") or None
        logger.info("Waking up the engine (tags: %s)", tags)
        try:
            awake = await engine.wake_up(tags)
        except ValueError as e:
            raise errors.bad_request(str(e), param="tags") from None
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})
