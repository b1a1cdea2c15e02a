"""The pagedllm Grafana dashboard, generated from code with grafana-foundation-sdk (pip install grafana-foundation-sdk,
in the test and deploy extras).

    python deploy/grafana/dashboard.py          # writes deploy/grafana/pagedllm.json
    python deploy/grafana/dashboard.py --check  # exits 1 when pagedllm.json is not what this file generates

Every query reads metric names `pagedllm serve` exports on /metrics (vLLM's `vllm:` names, so the same dashboard
reads a `vllm serve` fleet): tests/deploy/test_deploy_references.py fails when one is not in
src/pagedllm/metrics/prometheus.py, and deploy/prometheus/prove.py runs every query against a real Prometheus
scraping a real server under load and fails when one returns no data.

Variables: `datasource` (a Prometheus data source), `job`, `model_name` and `instance` (multi-select, "All" by default).
With data parallelism (--data-parallel-size N) every engine series carries `engine="<rank>"`: the "Engines" row
breaks the figures down by it (one engine: no engine label, one series).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

OUTPUT = Path(__file__).with_name("pagedllm.json")
UID = "pagedllm-overview"
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job", model_name=~"$model_name", instance=~"$instance"'
"""The label selector every query carries (the dashboard's variables)."""
RATE = "$__rate_interval"


def rate(metric: str, by: str = "", window: str = RATE) -> str:
    """sum [by (...)] (rate(metric{SEL}[window]))."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{SEL}}}[{window}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    """histogram_quantile over the buckets of `histogram` (its name without _bucket), summed over the series."""
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({histogram}_bucket{{{SEL}}}[{RATE}])))"


def target(expr: str, legend: str, ref: str) -> gp.Dataquery:
    return gp.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def graph(title: str, description: str, unit: str, queries: list[tuple[str, str]], width: int = 12,
          maximum: float | None = None) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .span(width).height(8).min(0).fill_opacity(10).line_width(1))
    if maximum is not None:
        panel = panel.max(maximum)
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(target(expr, legend, chr(ord("A") + i)))
    return panel


def single(title: str, description: str, unit: str, expr: str, maximum: float | None = None) -> stat.Panel:
    panel = (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(4)
             .height(4).with_target(target(expr, title, "A")))
    return panel if maximum is None else panel.max(maximum)


def percentiles(histogram: str, by: str = "", label: str = "") -> list[tuple[str, str]]:
    prefix = f"{label} " if label else ""
    return [(quantile(q, histogram, by), f"{prefix}p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


def overview_row() -> list:
    return [
        gd.Row("Overview"),
        single("Requests running", "Requests in the engines' running batches (vllm:num_requests_running), summed.",
               "short", f"sum (vllm:num_requests_running{{{SEL}}})"),
        single("Requests waiting", "Requests queued for a place in a batch (vllm:num_requests_waiting), summed. "
               "Growing = more load than the replicas serve: scale out (KEDA scales on this metric).", "short",
               f"sum (vllm:num_requests_waiting{{{SEL}}})"),
        single("KV cache usage (max over engines)", "Fraction of KV-cache blocks in use on the fullest engine.",
               "percentunit", f"max (vllm:kv_cache_usage_perc{{{SEL}}})", maximum=1),
        single("Prefix-cache hit rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.",
               "percentunit", f"{rate('vllm:prefix_cache_hits_total')} / {rate('vllm:prefix_cache_queries_total')}",
               maximum=1),
        single("Generation tokens/s", "Output tokens per second over all engines.", "short",
               rate("vllm:generation_tokens_total")),
        single("Servers up", "Scrape targets of the job answering /metrics (Prometheus' `up`); fewer than the "
               "replicas you run = a server down (alert PagedllmServerDown).", "short",
               'sum (up{job=~"$job", instance=~"$instance"})'),
    ]


def load_row() -> list:
    return [
        gd.Row("Load and KV cache"),
        graph("Requests running and waiting", "Per server (instance): the running batch and the waiting queue.",
              "short", [(f"sum by (instance) (vllm:num_requests_running{{{SEL}}})", "running {{instance}}"),
                        (f"sum by (instance) (vllm:num_requests_waiting{{{SEL}}})", "waiting {{instance}}")]),
        graph("KV cache usage", "Fraction of KV-cache blocks in use, per server and engine. Near 1: requests are "
              "preempted (recomputed) and the queue grows.", "percentunit",
              [(f"max by (instance, engine) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{instance}} engine {{engine}}")],
              maximum=1),
        graph("Preemptions/s", "Running requests preempted for lack of KV-cache blocks (they are recomputed later). "
              "Sustained: give the engine more --kv-cache-memory, lower --max-num-seqs, or add replicas.", "short",
              [(rate("vllm:num_preemptions_total", "instance"), "{{instance}}")]),
        graph("Admission rejections/s", "Requests refused with 503 because the waiting queue was full "
              "(--max-num-queued-reqs).", "short", [(rate("vllm:admission_rejections_total", "instance"),
                                                     "{{instance}}")]),
    ]


def latency_row() -> list:
    return [
        gd.Row("Latency"),
        graph("Time to first token", "TTFT percentiles from vllm:time_to_first_token_seconds.", "s",
              percentiles("vllm:time_to_first_token_seconds")),
        graph("Inter-token latency", "ITL percentiles from vllm:inter_token_latency_seconds (the gap between two "
              "output tokens of a request).", "s", percentiles("vllm:inter_token_latency_seconds")),
        graph("End-to-end request latency", "Percentiles of vllm:e2e_request_latency_seconds.", "s",
              percentiles("vllm:e2e_request_latency_seconds")),
        graph("Queue time", "Time requests waited before their first schedule (vllm:request_queue_time_seconds).",
              "s", percentiles("vllm:request_queue_time_seconds")),
        graph("Prefill and decode time (p90)", "Per request: time in prefill and in decode.", "s",
              [(quantile(0.9, "vllm:request_prefill_time_seconds"), "prefill p90"),
               (quantile(0.9, "vllm:request_decode_time_seconds"), "decode p90")]),
        graph("Request length (p90)", "Prompt and generated tokens per finished request.", "short",
              [(quantile(0.9, "vllm:request_prompt_tokens"), "prompt p90"),
               (quantile(0.9, "vllm:request_generation_tokens"), "generation p90")]),
    ]


def throughput_row() -> list:
    return [
        gd.Row("Throughput"),
        graph("Tokens/s", "Prompt (prefill) and generation tokens per second.", "short",
              [(rate("vllm:prompt_tokens_total"), "prompt"), (rate("vllm:generation_tokens_total"), "generation")]),
        graph("Finished requests/s by finish reason", "vllm:request_success_total by finished_reason: stop, length, "
              "abort (client gone, drain timeout), error.", "reqps",
              [(rate("vllm:request_success_total", "finished_reason"), "{{finished_reason}}")]),
        graph("Tokens per engine step", "Mean tokens (prompt + generation) an engine step computed.", "short",
              [(f"{rate('vllm:iteration_tokens_total_sum')} / {rate('vllm:iteration_tokens_total_count')}",
                "mean")]),
        graph("Request success ratio", "Requests that finished with stop or length / all finished requests.",
              "percentunit",
              [(f'sum (rate(vllm:request_success_total{{{SEL}, finished_reason=~"stop|length"}}[{RATE}])) / '
                f"{rate('vllm:request_success_total')}", "success")], maximum=1),
    ]


def speculative_row() -> list:
    drafts = rate("vllm:spec_decode_num_drafts_total")
    draft_tokens = rate("vllm:spec_decode_num_draft_tokens_total")
    accepted = rate("vllm:spec_decode_num_accepted_tokens_total")
    return [
        gd.Row("Speculative decoding (with --speculative-config)"),
        graph("Draft acceptance rate", "Accepted draft tokens / proposed draft tokens.", "percentunit",
              [(f"{accepted} / {draft_tokens}", "acceptance rate")], width=8, maximum=1),
        graph("Mean acceptance length", "Tokens per verification step: 1 + accepted draft tokens per draft.", "short",
              [(f"1 + {accepted} / {drafts}", "mean acceptance length")], width=8),
        graph("Acceptance by draft position", "Accepted tokens at each draft position / drafts.", "percentunit",
              [(f"{rate('vllm:spec_decode_num_accepted_tokens_per_pos_total', 'position')} / ignoring (position) "
                f"group_left {drafts}", "position {{position}}")], width=8, maximum=1),
    ]


def engines_row() -> list:
    return [
        gd.Row("Engines (data-parallel replicas)"),
        graph("Requests running by engine", "One series per server and engine (DP rank).", "short",
              [(f"sum by (instance, engine) (vllm:num_requests_running{{{SEL}}})", "{{instance}} engine {{engine}}")],
              width=8),
        graph("Generation tokens/s by engine", "Output tokens per second of each engine.", "short",
              [(rate("vllm:generation_tokens_total", "instance, engine"), "{{instance}} engine {{engine}}")],
              width=8),
        graph("TTFT p90 by engine", "Time to first token, p90, per engine.", "s",
              [(quantile(0.9, "vllm:time_to_first_token_seconds", "instance, engine"),
                "{{instance}} engine {{engine}}")], width=8),
    ]


def label_variable(name: str, label: str, query: str) -> gd.QueryVariable:
    """A multi-select of a label's values, "All" (any value, `.*`) selected by default."""
    return (gd.QueryVariable(name).label(label).datasource(DATASOURCE).query(query).multi(True).include_all(True)
            .all_value(".*").current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC))


def variables() -> list:
    return [
        gd.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        label_variable("job", "Job", "label_values(vllm:num_requests_running, job)"),
        label_variable("model_name", "Model", 'label_values(vllm:num_requests_running{job=~"$job"}, model_name)'),
        label_variable("instance", "Instance",
                       'label_values(vllm:num_requests_running{job=~"$job", model_name=~"$model_name"}, instance)'),
    ]


def build() -> dict:
    board = (gd.Dashboard("pagedllm").uid(UID).tags(["pagedllm", "vllm", "llm"]).refresh("30s").time("now-1h", "now")
             .description("pagedllm (and vLLM) servers: load, KV cache, latency, throughput, speculative decoding "
                          "and the data-parallel engines. Generated by deploy/grafana/dashboard.py.")
             .timezone("browser").editable())
    for variable in variables():
        board = board.with_variable(variable)
    for row in (overview_row(), load_row(), latency_row(), throughput_row(), speculative_row(), engines_row()):
        for item in row:
            board = board.with_row(item) if isinstance(item, gd.Row) else board.with_panel(item)
    built = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for number, panel in enumerate(built["panels"], start=1):  # unique ids: Grafana links and edits panels by id
        panel["id"] = number
    return built


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel of a dashboard (rows included)."""
    found = []
    for panel in board.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for t in inner.get("targets", []):
                found.append((inner.get("title", ""), t["expr"]))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python {Path(__file__).relative_to(Path.cwd())}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT} ({len(queries(build()))} queries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
