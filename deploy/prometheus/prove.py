"""Proof of the dashboard and the alerts against a real Prometheus scraping a real `pagedllm serve` under load.

    python deploy/prometheus/prove.py                 # SmolLM2 (the default model), 2 DP engines, ngram speculation
    python deploy/prometheus/prove.py --model DIR --serve-flag=--max-model-len=256 ...

It starts the server (loopback, a free port), a real `prometheus` (Debian's package: `prometheus` on PATH) with a
temporary configuration (job "pagedllm", a 1 s scrape and rule-evaluation interval, deploy/prometheus/alerts.yaml
as its rule file) and a temporary data directory, drives a small load with the repo's bench client (`pagedllm bench
serve`, the copy-heavy dataset, where ngram speculation drafts), then asks Prometheus' HTTP API for:

- every query of every panel of deploy/grafana/pagedllm.json (Grafana's variables replaced: $job by pagedllm,
  $model_name and $instance by .*, $__rate_interval by --rate-window) as a range query over the load: each must
  return at least one series with a finite value;
- every recording rule of alerts.yaml: each must return a finite value (the SLO error ratios over real histograms);
- every alert expression: it must evaluate without an error, and every series selector in it (`vllm:...{job=
  "pagedllm", le="2.5"}`, `up{job="pagedllm"}`) must match a real series, so that no alert is silently dead
  through a wrong metric name or label; and /api/v1/rules must report every rule healthy;
- after the server's SIGTERM: `up{job="pagedllm"} == 0`, the condition of PagedllmServerDown, must hold.

Exit status 0 when everything holds; a table of the results on stdout (benchmarks/RESULTS.md keeps one run).
tests/deploy/test_prometheus_proof.py runs the same with the tiny test model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RULES = HERE / "alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "pagedllm.json"
JOB = "pagedllm"
DEFAULT_SERVE_FLAGS = ["--data-parallel-size", "2", "--kv-cache-memory", "512MiB",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
SELECTOR = re.compile(r"\b((?:vllm|pagedllm):[a-zA-Z0-9_:]+|up)(\{[^}]*\})?(?!\s*\()")


@dataclass
class Check:
    kind: str
    name: str
    expr: str
    ok: bool
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def table(self) -> str:
        lines = ["| kind | name | result |", "| --- | --- | --- |"]
        for c in self.checks:
            lines.append(f"| {c.kind} | {c.name} | {'ok' if c.ok else 'FAIL'}: {c.detail} |")
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        if http_get(url, timeout=2)[0] == 200:
            return time.monotonic() - start
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s")


def pagedllm_command() -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli.main"]


def prometheus_config(target: str, scrape_s: float) -> dict:
    interval = f"{round(scrape_s * 1000)}ms"  # Prometheus' durations take no fractions
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics",
                                "static_configs": [{"targets": [target]}]}]}


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **params: str) -> dict:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30)
        data = json.loads(body or b"{}")
        if status != 200 or data.get("status") != "success":
            raise RuntimeError(f"{path} {params.get('query', '')}: HTTP {status} {data.get('error', body[:200])}")
        return data["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}s")["result"]


def finite_values(result: list[dict]) -> list[float]:
    values = []
    for series in result:
        samples = series.get("values") or [series["value"]]
        values += [float(v) for _, v in samples if math.isfinite(float(v))]
    return values


def grafana_to_promql(expr: str, rate_window: str) -> str:
    return (expr.replace("$__rate_interval", rate_window).replace('"$job"', f'"{JOB}"')
            .replace('"$model_name"', '".*"').replace('"$instance"', '".*"'))


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            found.append((panel["title"], t["expr"]))
    return found


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def check_dashboard(prom: Prometheus, start: float, end: float, rate_window: str) -> list[Check]:
    checks = []
    for title, expr in dashboard_queries():
        promql = grafana_to_promql(expr, rate_window)
        try:
            result = prom.query_range(promql, start, end, 1.0)
        except RuntimeError as e:
            checks.append(Check("panel", title, promql, False, str(e)))
            continue
        values = finite_values(result)
        ok = bool(values)
        detail = (f"{len(result)} series, max {max(values):.4g}" if ok else f"{len(result)} series, no finite value")
        checks.append(Check("panel", title, promql, ok, detail))
    return checks


def check_rules(prom: Prometheus) -> list[Check]:
    checks = []
    for rule in rules():
        name = rule.get("record") or rule["alert"]
        try:
            if "record" in rule:
                values = finite_values(prom.query(rule["record"]))
                checks.append(Check("recording rule", name, rule["record"], bool(values),
                                    f"value {values[0]:.4g}" if values else "no finite value"))
                continue
            result = prom.query(rule["expr"])
            missing = [s for s in selectors(rule["expr"]) if not prom.query(f"count({s})")]
            detail = f"evaluates ({len(result)} series now); " + (
                f"selectors matching nothing: {missing}" if missing else
                f"all {len(selectors(rule['expr']))} selectors match series")
            checks.append(Check("alert", name, rule["expr"].strip(), not missing, detail))
        except RuntimeError as e:
            checks.append(Check("alert" if "alert" in rule else "recording rule", name, rule.get("expr", ""),
                                False, str(e)))
    groups = prom.api("rules")["groups"]
    unhealthy = [r["name"] for g in groups for r in g["rules"] if r.get("health") != "ok"]
    count = sum(len(g["rules"]) for g in groups)
    checks.append(Check("rules API", "every rule healthy", "/api/v1/rules", not unhealthy and count == len(rules()),
                        f"{count} rules loaded, unhealthy: {unhealthy or 'none'}"))
    return checks


def selectors(expr: str) -> list[str]:
    """The series selectors of a PromQL expression: metric names (vllm:..., up, and the pagedllm:... series of the
    recording rules) with their label matchers."""
    return list(dict.fromkeys(name + (matchers or "") for name, matchers in SELECTOR.findall(expr)))


def run_load(base_url: str, num_prompts: int, concurrency: int, output_len: int, log, bench_flags: list[str]) -> None:
    """`pagedllm bench serve` (in this process: no second interpreter's start-up), its report into `log`."""
    from pagedllm.entrypoints.cli.main import main as pagedllm_main

    # copy-heavy: the output repeats the prompt, so ngram speculation drafts and gets tokens accepted
    args = ["bench", "serve", "--base-url", base_url, "--dataset-name", "copy-heavy", "--num-prompts",
            str(num_prompts), "--max-concurrency", str(concurrency), "--copy-heavy-output-len", str(output_len),
            "--disable-tqdm", "--num-warmups", "0", "--seed", "0", *bench_flags]
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        status = pagedllm_main(args)
    if status:
        raise RuntimeError(f"pagedllm bench serve exited with {status}")


def prove(model: str | None = None, serve_flags: list[str] | None = None, num_prompts: int = 24,
          concurrency: int = 6, output_len: int = 48, scrape_s: float = 1.0, rate_window: str = "20s",
          workdir: Path | None = None, server_timeout: float = 300.0, bench_flags: list[str] = (),
          env: dict[str, str] | None = None) -> Report:
    """Runs the whole proof; `serve_flags` replace DEFAULT_SERVE_FLAGS, `bench_flags` go to `pagedllm bench serve`
    (its --tokenizer for a model served from a folder), `env` to the server (default: this process')."""
    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        raise RuntimeError("prometheus is not on PATH (apt-get install prometheus)")
    report = Report()
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-prove-")) if own_dir else workdir
    server_port, prom_port = free_port(), free_port()
    base_url = f"http://127.0.0.1:{server_port}"
    flags = DEFAULT_SERVE_FLAGS if serve_flags is None else serve_flags
    command = [*pagedllm_command(), "serve", *([model] if model else []), "--host", "127.0.0.1", "--port",
               str(server_port), *flags]
    server_log = open(workdir / "server.log", "w")
    prom_log = open(workdir / "prometheus.log", "w")
    server = prom = None
    try:
        start = time.monotonic()
        env = dict(os.environ if env is None else env)
        server = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env=env)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(f"127.0.0.1:{server_port}",
                                                                                  scrape_s)))
        prom = subprocess.Popen([prometheus_bin, f"--config.file={workdir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                                stdout=prom_log, stderr=subprocess.STDOUT, start_new_session=True)
        prom_url = f"http://127.0.0.1:{prom_port}"
        report.timings["prometheus ready (s)"] = wait_ready(f"{prom_url}/-/ready", prom, 60, "prometheus")
        report.timings["server healthy (s)"] = wait_ready(f"{base_url}/health", server, server_timeout, "server")
        # The load must start after Prometheus has scraped the idle server (else a rate over the load has one
        # sample and no value): wait for its first successful scrape, then one more interval.
        deadline = time.monotonic() + 60
        while not Prometheus(f"http://127.0.0.1:{prom_port}").query(f'up{{job="{JOB}"}} == 1'):
            if time.monotonic() > deadline:
                raise RuntimeError("Prometheus never scraped the server")
            time.sleep(scrape_s / 2)
        time.sleep(2 * scrape_s)
        load_start = time.time()
        run_load(base_url, num_prompts, concurrency, output_len, server_log, list(bench_flags))
        load_end = time.time()
        report.timings["load (s)"] = load_end - load_start
        time.sleep(3 * scrape_s)  # the last scrape after the load, and a rule evaluation over it
        prometheus = Prometheus(prom_url)
        queries_start = time.monotonic()
        report.checks += check_dashboard(prometheus, load_start, time.time(), rate_window)
        report.checks += check_rules(prometheus)
        active = sorted({f"{a['labels']['alertname']} ({a['state']})" for a in prometheus.api("alerts")["alerts"]})
        report.checks.append(Check("info", "alerts pending or firing after the load", "/api/v1/alerts", True,
                                   ", ".join(active) or "none"))
        report.timings["queries (s)"] = time.monotonic() - queries_start
        # SIGTERM: the server drains and exits; Prometheus' next scrapes fail
        stop_start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        deadline = time.monotonic() + 20 * scrape_s
        down: list[dict] = []
        while time.monotonic() < deadline and not down:
            time.sleep(scrape_s)
            down = prometheus.query(f'up{{job="{JOB}"}} == 0')
        report.checks.append(Check("alert condition", "PagedllmServerDown after SIGTERM", f'up{{job="{JOB}"}} == 0',
                                   bool(down), "up == 0 for the stopped server" if down else "up never fell to 0"))
        report.timings["stop and up == 0 (s)"] = time.monotonic() - stop_start
        report.timings["total (s)"] = time.monotonic() - start
        return report
    finally:
        for proc in (server, prom):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        server_log.close()
        prom_log.close()
        if own_dir and report.ok:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not report.ok:
            print(f"logs kept in {workdir}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to serve (default: pagedllm's default, SmolLM2)")
    parser.add_argument("--serve-flag", action="append", default=None,
                        help=f"a `pagedllm serve` flag (repeat; default: {' '.join(DEFAULT_SERVE_FLAGS)})")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rate-window", default="20s", help="what $__rate_interval becomes (default 20s)")
    args = parser.parse_args()
    flags = None if args.serve_flag is None else [f for flag in args.serve_flag for f in flag.split("=", 1)]
    report = prove(args.model, flags, args.num_prompts, args.concurrency, args.output_len,
                   rate_window=args.rate_window)
    print(report.table())
    print()
    print(" ".join(f"{k}: {v:.1f}" for k, v in report.timings.items()))
    failed = [c for c in report.checks if not c.ok]
    print(f"{len(report.checks) - len(failed)} of {len(report.checks)} checks passed")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
