"""Writes deploy/prometheus/alerts_test.yaml, promtool's unit tests of alerts.yaml: for every alert a case where it
fires and at least one where it stays quiet, on synthetic series with pagedllm's metric names.

    python deploy/prometheus/make_alert_tests.py           # writes alerts_test.yaml
    python deploy/prometheus/make_alert_tests.py --check   # exits 1 when alerts_test.yaml is stale
    promtool test rules deploy/prometheus/alerts_test.yaml

promtool compares an alert's annotations too, so the expected annotations are alerts.yaml's, rendered here for the
template forms the rules use ({{ $labels.NAME }}, {{ $value | humanize }}, {{ $value | humanizePercentage }}) with
the value each case states: a changed annotation regenerates the file, a wrong threshold or expression fails
promtool. tests/deploy/test_alert_rules.py runs both checks.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
RULES = HERE / "alerts.yaml"
OUTPUT = HERE / "alerts_test.yaml"
SERVER = {"job": "pagedllm", "instance": "10.0.0.1:8000", "model_name": "smollm2"}
"""The labels of one scraped server."""


def series(name: str, values: str, **labels: str) -> dict:
    merged = {**SERVER, **labels}
    body = ", ".join(f'{k}="{v}"' for k, v in merged.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def slo_series(histogram: str, le: str, good_per_min: float, total_per_min: float, minutes: int) -> list[dict]:
    """A histogram's bucket at the SLO bound and its count, growing linearly: good/total requests per minute."""
    return [series(f"{histogram}_bucket", f"0+{good_per_min}x{minutes}", le=le),
            series(f"{histogram}_count", f"0+{total_per_min}x{minutes}")]


TTFT = ("vllm:time_to_first_token_seconds", "2.5")
ITL = ("vllm:inter_token_latency_seconds", "0.2")
SLO_LABELS = {"job": "pagedllm", "model_name": "smollm2"}
"""The burn-rate alerts aggregate by job and model (every instance and engine of a model together)."""

CASES: list[dict] = []
"""Each: a name, the input series, and checks (alert, eval_time, expected [(labels, value)] or [] for quiet)."""


def case(name: str, input_series: list[dict], *checks: tuple[str, str, list[tuple[dict, str]]]) -> None:
    CASES.append({"name": name, "series": input_series, "checks": checks})


for kind, (histogram, le) in (("TTFT", TTFT), ("ITL", ITL)):
    fast, slow = f"Pagedllm{kind}BudgetBurnFast", f"Pagedllm{kind}BudgetBurnSlow"
    case(f"{kind}: 20% of requests miss the SLO for 90 minutes: both burn alerts fire",
         slo_series(histogram, le, 80, 100, 90),
         (fast, "60m", [(SLO_LABELS, "20%")]), (slow, "60m", [(SLO_LABELS, "20%")]))
    case(f"{kind}: 10% miss for 90 minutes: a slow burn only (10% < 14.4%, > 6%)",
         slo_series(histogram, le, 90, 100, 90),
         (fast, "60m", []), (slow, "60m", [(SLO_LABELS, "10%")]))
    case(f"{kind}: 0.5% miss, within the 1% budget: quiet",
         slo_series(histogram, le, 995, 1000, 90),
         (fast, "60m", []), (slow, "60m", []))
    case(f"{kind}: a 5-minute spike of misses after 55 good minutes: the 1-hour window keeps the fast burn quiet",
         [series(f"{histogram}_bucket", "0+995x55 54725+0x10", le=le), series(f"{histogram}_count", "0+1000x65")],
         (fast, "61m", []))
    case(f"{kind}: no traffic at all (NaN ratios): quiet",
         slo_series(histogram, le, 0, 0, 90), (fast, "60m", []), (slow, "60m", []))

SERVER_LABELS = dict(SERVER)
case("queue never empty and growing for 20 minutes: PagedllmQueueGrowing fires",
     [series("vllm:num_requests_waiting", "1+1x30")],
     ("PagedllmQueueGrowing", "20m", [(SERVER_LABELS, "")]))
case("queue empty: quiet", [series("vllm:num_requests_waiting", "0x30")], ("PagedllmQueueGrowing", "20m", []))
case("a long queue that shrinks: quiet", [series("vllm:num_requests_waiting", "60-1x30")],
     ("PagedllmQueueGrowing", "20m", []))
case("a queue that empties now and then: quiet",
     [series("vllm:num_requests_waiting", "0 5 10 15 20 25 0 5 10 15 20 25 0 5 10 15 20 25 0 5 10 15 20 25 30")],
     ("PagedllmQueueGrowing", "24m", []))
case("KV cache 95% full for 15 minutes: PagedllmKVCacheNearFull fires",
     [series("vllm:kv_cache_usage_perc", "0.95x20")],
     ("PagedllmKVCacheNearFull", "15m", [(SERVER_LABELS, "95%")]))
case("KV cache 95% full on engine 1 of two (data parallelism): fires with the engine label",
     [series("vllm:kv_cache_usage_perc", "0.4x20", engine="0"),
      series("vllm:kv_cache_usage_perc", "0.95x20", engine="1")],
     ("PagedllmKVCacheNearFull", "15m", [({**SERVER_LABELS, "engine": "1"}, "95%")]))
case("KV cache half full: quiet", [series("vllm:kv_cache_usage_perc", "0.5x20")],
     ("PagedllmKVCacheNearFull", "15m", []))
case("KV cache full for 3 minutes only: quiet",
     [series("vllm:kv_cache_usage_perc", "0.5x10 0.99x2 0.5x8")], ("PagedllmKVCacheNearFull", "15m", []))
case("2 preemptions a minute for 30 minutes: PagedllmPreemptions fires",
     [series("vllm:num_preemptions_total", "0+2x30")],
     ("PagedllmPreemptions", "25m", [(SERVER_LABELS, "2")]))
case("a preemption every 2 minutes: quiet", [series("vllm:num_preemptions_total", "0+0.5x30")],
     ("PagedllmPreemptions", "25m", []))
case("scrape failing for 5 minutes: PagedllmServerDown fires",
     [{"series": 'up{job="pagedllm", instance="10.0.0.1:8000"}', "values": "1 1 0x8"}],
     ("PagedllmServerDown", "8m", [({"job": "pagedllm", "instance": "10.0.0.1:8000"}, "")]))
case("scrape failing for 1 minute (a restart): quiet",
     [{"series": 'up{job="pagedllm", instance="10.0.0.1:8000"}', "values": "1 1 0 1x8"}],
     ("PagedllmServerDown", "8m", []))
case("no pagedllm target (another job's only): PagedllmTargetsAbsent fires",
     [{"series": 'up{job="node", instance="10.0.0.9:9100"}', "values": "1x10"}],
     ("PagedllmTargetsAbsent", "8m", [({"job": "pagedllm"}, "")]))
case("a pagedllm target, even down: PagedllmTargetsAbsent quiet",
     [{"series": 'up{job="pagedllm", instance="10.0.0.1:8000"}', "values": "0x10"}],
     ("PagedllmTargetsAbsent", "8m", []))
case("2 requests running and no token for 10 minutes: PagedllmNoTokensWhileRunning fires",
     [series("vllm:num_requests_running", "2x10"), series("vllm:generation_tokens_total", "500x10"),
      series("vllm:prompt_tokens_total", "900x10")],
     ("PagedllmNoTokensWhileRunning", "9m", [(SERVER_LABELS, "")]))
case("requests running and tokens flowing: quiet",
     [series("vllm:num_requests_running", "2x10"), series("vllm:generation_tokens_total", "0+300x10"),
      series("vllm:prompt_tokens_total", "0+50x10")],
     ("PagedllmNoTokensWhileRunning", "9m", []))
case("a long prefill (prompt tokens only, no output yet): quiet",
     [series("vllm:num_requests_running", "1x10"), series("vllm:generation_tokens_total", "0x10"),
      series("vllm:prompt_tokens_total", "0+4000x10")],
     ("PagedllmNoTokensWhileRunning", "9m", []))
case("idle (nothing running, no tokens): quiet",
     [series("vllm:num_requests_running", "0x10"), series("vllm:generation_tokens_total", "500x10"),
      series("vllm:prompt_tokens_total", "900x10")],
     ("PagedllmNoTokensWhileRunning", "9m", []))

_TEMPLATE = re.compile(r"\{\{\s*\$(labels\.(\w+)|value(\s*\|\s*(\w+))?)\s*\}\}")


def render(text: str, labels: dict, value: str) -> str:
    """alerts.yaml's annotation with its templates filled in: the alert's labels, and the value the case states
    (as `humanize` or `humanizePercentage` prints it)."""

    def fill(m: re.Match) -> str:
        if m.group(2):
            return labels.get(m.group(2), "")
        return value

    return _TEMPLATE.sub(fill, text)


def rules_by_alert() -> dict[str, dict]:
    rules = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


def build() -> dict:
    rules = rules_by_alert()
    tests = []
    for c in CASES:
        checks = []
        for alert, eval_time, expected in c["checks"]:
            rule = rules[alert]
            exp = []
            for labels, value in expected:
                all_labels = {**labels, **rule.get("labels", {})}
                exp.append({"exp_labels": all_labels,
                            "exp_annotations": {k: render(v, all_labels, value)
                                                for k, v in rule.get("annotations", {}).items()}})
            checks.append({"eval_time": eval_time, "alertname": alert, "exp_alerts": exp})
        tests.append({"name": c["name"], "interval": "1m", "input_series": c["series"], "alert_rule_test": checks})
    return {"rule_files": [RULES.name], "evaluation_interval": "1m", "tests": tests}


def covered() -> dict[str, tuple[bool, bool]]:
    """alert -> (has a firing case, has a quiet case)."""
    seen: dict[str, tuple[bool, bool]] = {}
    for c in CASES:
        for alert, _, expected in c["checks"]:
            fires, quiet = seen.get(alert, (False, False))
            seen[alert] = (fires or bool(expected), quiet or not expected)
    return seen


def render_file() -> str:
    header = ("# Generated by deploy/prometheus/make_alert_tests.py from its cases and alerts.yaml's annotations: "
              "edit those, then run it.\n# promtool test rules deploy/prometheus/alerts_test.yaml\n")
    return header + yaml.safe_dump(build(), sort_keys=False, width=120, allow_unicode=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when alerts_test.yaml is stale")
    args = parser.parse_args()
    missing = [a for a in rules_by_alert() if covered().get(a) != (True, True)]
    if missing:
        print(f"alerts without both a firing and a quiet case: {missing}", file=sys.stderr)
        return 1
    text = render_file()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python deploy/prometheus/make_alert_tests.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}: {len(CASES)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
