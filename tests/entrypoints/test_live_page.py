"""The live page (GET / and /dashboard, data from GET /dashboard/data) in headless Chromium, against one real server
with --api-key and --root-path under a small load of streamed completions: the figures move, and once the load
stops they equal what /metrics says. The screenshot in docs/ comes from scripts/live_page_screenshot.py."""

from __future__ import annotations

import math
import time

import httpx
import pytest
from live_page_browser import Load, chromium_page, number, require_chromium
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MODEL_NAME, RemoteServer

KEY = "live-page-key"
PREFIX = "/api"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = RemoteServer(tiny_llama_dir, "--api-key", KEY, "--root-path", PREFIX, "--max-num-seqs", "2",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    srv.headers = AUTH
    yield srv
    srv.close()


def scrape(server: RemoteServer) -> dict[str, float]:
    """/metrics summed over labels per sample name (histogram buckets keyed by name and bound)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            key = f"{s.name}{{le={s.labels['le']}}}" if "le" in s.labels else s.name
            values[key] = values.get(key, 0.0) + s.value
    return values


def quantile_from_scrapes(q: float, name: str, after: dict, before: dict) -> float | None:
    """histogram_quantile(q, increase(name_bucket)) between two scrapes, written out independently of the server."""
    prefix = f"{name}_bucket{{le="
    buckets = sorted((float(k[len(prefix):-1]), v - before.get(k, 0.0)) for k, v in after.items()
                     if k.startswith(prefix))
    total = buckets[-1][1]
    if total <= 0:
        return None
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= q * total:
            return lower if math.isinf(bound) else lower + (bound - lower) * (q * total - below) / (count - below)
        lower, below = bound, count
    return lower


def test_page_loads_without_the_key_its_data_needs_it_under_the_root_path(server):
    for path in ("/", "/dashboard", f"{PREFIX}/", f"{PREFIX}/dashboard"):
        r = server.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert "dashboard/data" in r.text and "http" not in r.text.split("<script>")[1]  # nothing from elsewhere
    for path in ("/dashboard/data", f"{PREFIX}/dashboard/data"):
        assert server.get(path).status_code == 401
        assert server.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        data = server.get(path, headers=AUTH).json()
        assert data["server"]["model"] == MODEL_NAME and data["engines"][0]["status"] == "up"
        assert data["engines"][0]["ranks"] == [{"pp_rank": 0, "tp_rank": 0, "status": "up"}]
    assert "/dashboard/data" not in server.get("/openapi.json", headers=AUTH).json()["paths"]


def test_live_page_in_chromium_moves_under_load_and_matches_metrics(server):
    require_chromium()
    before = scrape(server)
    with chromium_page() as page:
        page.goto(f"{server.url}{PREFIX}/dashboard?interval=500")
        page.wait_for_selector("#auth", state="visible")  # no key yet: the page asks for it
        page.fill("#key", KEY)
        page.click("#auth button")
        page.wait_for_function("document.getElementById('status-text').textContent === 'live'", timeout=15000)
        load = Load(server.url, MODEL_NAME, KEY, concurrency=4)
        try:
            seen_running = seen_waiting = seen_tps = 0.0
            gen_totals, floors = [], []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (seen_running and seen_waiting and seen_tps
                                                       and len(set(gen_totals)) >= 3):
                floors.append(scrape(server)["vllm:generation_tokens_total"])
                updated = page.get_attribute("body", "data-updated")
                page.wait_for_function(f"document.body.dataset.updated !== '{updated}'", timeout=10000)
                shown = number(page.inner_text("#total-gen"))
                # what a scrape-time difference allows: the page's sample is no newer than the scrape after it, and
                # (polls 0.5 s apart, a sample reused for 1 s at most) no older than the scrape two updates before
                assert (floors[-3] if len(floors) >= 3 else 0.0) <= shown <= scrape(server)[
                    "vllm:generation_tokens_total"]
                gen_totals.append(shown)
                seen_running = max(seen_running, number(page.inner_text("#running")))
                seen_waiting = max(seen_waiting, number(page.inner_text("#waiting")))
                seen_tps = max(seen_tps, number(page.inner_text("#gen-tps")) or 0.0)
                assert number(page.inner_text("#running")) <= 2  # --max-num-seqs 2
        finally:
            load.stop()
        assert not load.errors, load.errors[:3]
        assert seen_running > 0 and seen_waiting > 0 and seen_tps > 0, (seen_running, seen_waiting, seen_tps)
        assert gen_totals == sorted(gen_totals) and len(set(gen_totals)) >= 3  # the figures move

        server.wait_idle()
        after = scrape(server)
        for _ in range(2):  # two fresh samples after the load: both sides now read the same counters
            updated = page.get_attribute("body", "data-updated")
            page.wait_for_function(f"document.body.dataset.updated !== '{updated}'", timeout=10000)
        assert number(page.inner_text("#total-gen")) == after["vllm:generation_tokens_total"]
        assert number(page.inner_text("#total-prompt")) == after["vllm:prompt_tokens_total"]
        assert number(page.inner_text("#total-requests")) == after["vllm:request_success_total"]
        assert number(page.inner_text("#running")) == 0 == after["vllm:num_requests_running"]
        assert number(page.inner_text("#kv-usage")) == pytest.approx(after["vllm:kv_cache_usage_perc"], abs=5e-4)
        hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0.0)
        queries = after["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0.0)
        assert hits > 0 and number(page.inner_text("#hit-rate")) == pytest.approx(hits / queries, abs=6e-4)
        for row, name in (("ttft", "vllm:time_to_first_token_seconds"), ("itl", "vllm:inter_token_latency_seconds")):
            cells = page.query_selector_all(f"#lat-{row} td")
            for cell, q in zip(cells[1:4], (0.5, 0.9, 0.99), strict=True):
                expected = quantile_from_scrapes(q, name, after, before)
                assert number(cell.inner_text()) == pytest.approx(expected, rel=5e-3, abs=6e-5), (row, q)
        drafted = after.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
        if drafted:  # ngram drafts only where the random model's output repeats itself
            assert number(page.inner_text("#spec-rate")) == pytest.approx(accepted / drafted, abs=6e-4)
        assert "mean acceptance length" in page.inner_text("#spec-sub")
        assert page.inner_text("#engines tbody tr[data-rank='0'] .health").strip() == "up"


def test_dashboard_data_is_one_sample_a_second_however_often_it_is_asked(server):
    first = server.get("/dashboard/data", headers=AUTH).json()
    again = server.get("/dashboard/data", headers=AUTH).json()
    assert again["time"] == first["time"]  # within min_interval_s: the same sample, the metrics not read again
    with httpx.Client() as client:
        later = [client.get(server.url + "/dashboard/data", headers=AUTH).json()["time"] for _ in range(3)]
    assert later[-1] - first["time"] < 5
