"""The live page: GET / and GET /dashboard serve one static HTML file (live_page.html: plain HTML, JS and inline SVG,
no build step, nothing fetched from elsewhere); it polls GET /dashboard/data every 2 s while it is visible.

/dashboard/data is computed from the metric families /metrics formats (metrics/live_samples.py), so its figures
are what a scrape sees. With --api-key the page itself loads without the key (it holds no data), but
/dashboard/data needs it like every other route: the page asks for the key, keeps it in the tab's sessionStorage and
sends it as `Authorization: Bearer`. Like /metrics, the page and its data still answer during a SIGTERM drain and
with the engine dead (middleware.OBSERVING_PATHS), so the page shows "draining" or the dead engine and its reason
instead of a 503. Every URL the page uses is relative to where it was loaded, so it works under
--root-path and behind a prefix-stripping proxy.
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse

import pagedllm
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.metrics.live_samples import LiveSamples

PAGE_PATHS = ("/", "/dashboard")
DATA_PATH = "/dashboard/data"
STALL_S = 10.0
"""An engine with requests and no finished step for this long shows as stalled."""


def page_html() -> bytes:
    return resources.files(__package__).joinpath("live_page.html").read_bytes()


def add_live_page_routes(app: FastAPI, state: ServerState) -> None:
    html = page_html()
    engine = state.engine
    samples = LiveSamples(engine.prometheus.collect)

    async def page():
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    for path in PAGE_PATHS:
        app.add_api_route(path, page, methods=["GET"], response_class=HTMLResponse, include_in_schema=False)

    @app.get(DATA_PATH, include_in_schema=False)
    async def dashboard_data(since: float = Query(0.0)):
        body = samples.figures(since)
        body["server"] = {"model": state.served_model_names[0], "version": pagedllm.__version__,
                          "uptime_s": time.time() - state.started, "api_servers": engine.num_api_servers,
                          "draining": state.draining, **state.parallel}
        body["engines"] = engine_health(state, body.pop("engine_gauges"))
        return JSONResponse(body, headers={"Cache-Control": "no-store"})


def engine_health(state: ServerState, gauges: dict[str, dict[str, float]]) -> list[dict]:
    """Each data-parallel replica: up / stalled / down, its gauges from the metrics, and its TP x PP ranks (a rank
    shares its replica's health: a worker that dies takes its engine core down with it)."""
    engine = state.engine
    now = time.monotonic()
    tp, pp = state.parallel.get("tensor_parallel_size", 1), state.parallel.get("pipeline_parallel_size", 1)
    replicas = []
    for replica, client in enumerate(engine.clients):
        stats = engine.scheduler_stats[replica]
        idle_s = now - engine.last_progress_time[replica]
        busy = stats.num_running_reqs + stats.num_waiting_reqs > 0
        status = "down" if client.is_dead else "stalled" if busy and idle_s > STALL_S else "up"
        replicas.append({
            "rank": replica, "status": status, "reason": client.dead_reason if client.is_dead else None,
            "pid": client.ready.pid, "since_last_step_s": idle_s if busy else None,
            **gauges.get(str(replica), {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}),
            "ranks": [{"pp_rank": stage, "tp_rank": rank, "status": status} for stage in range(pp)
                      for rank in range(tp)]})
    return replicas
