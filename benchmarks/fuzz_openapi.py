"""Schemathesis against a real `pagedllm serve`'s OpenAPI document (issue 6, "Fuzzing").

    .venv/bin/python benchmarks/fuzz_openapi.py [--cases 2000] [--url URL] [--api-key KEY] [--seed N]
        [--result-file out.json] [-- EXTRA SERVE FLAGS]

Loads /openapi.json, and sends `--cases` requests generated from it (schemathesis 4 strategies driven by
Hypothesis, schema-valid and schema-invalid bodies alike), spread over the operations: 30% each to
/v1/completions and /v1/chat/completions, 20% to /v1/responses, 10% each to /tokenize and /detokenize, one to each
GET route that takes no input (GET /v1/responses/{id}, which does, gets one too).
Generated requests ask for at most MAX_TOKENS tokens (a larger max_tokens, max_completion_tokens or min_tokens
is lowered to it, and a chat request that sets neither gets it), so the run tests input handling rather than
generation speed. Checks: no response >= 500 except 503, the engine process is the same one at the end and
/health is 200 (the server never restarted), and (for a server it started) no unexpected error in its log.
Prints the number of cases by operation and status and every failure (with a curl command that repeats it);
exits 1 if any check fails.

Without `--url`, starts the tiny random Llama of tests/conftest.py (GGUF) with --enable-debug-routes; with
`--url`, the server must have --enable-debug-routes (the engine pid is read from /debug/kv_cache).
tests/reliability/test_openapi_fuzz.py runs the same `fuzz()` at CI size (a few hundred cases).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import GenerationMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from server_process import build_tiny_model  # noqa: E402

MAX_TOKENS = 8
"""The most tokens a generated request may ask for (a larger ask is lowered to it)."""

LOG_ALARMS = ("ERROR", "CRITICAL", "Traceback")
"""How a line of the server's log that means a bug starts, even under a 4xx: an exception the handlers did not
expect is logged at ERROR with its traceback. A line is matched at its start only, since a WARNING line may quote the
request (the ignored fields' names), and a fuzzed field may be named "internal error"."""


def log_alarms(log: str) -> list[str]:
    """The lines of a server log that mean a bug (see LOG_ALARMS)."""
    return [line for line in log.splitlines() if line.startswith(LOG_ALARMS)]

WEIGHTS = {("POST", "/v1/completions"): 0.3, ("POST", "/v1/chat/completions"): 0.3, ("POST", "/v1/responses"): 0.2,
           ("POST", "/tokenize"): 0.1, ("POST", "/detokenize"): 0.1}
"""Shares of the cases among the operations that take input (a route without input gets one case)."""


@dataclass
class FuzzResult:
    statuses: Counter = field(default_factory=Counter)
    """(operation label, status) -> number of responses."""
    failures: list[str] = field(default_factory=list)
    """One line per response >= 500 other than 503 (or request error), with a curl command to repeat it."""
    seconds: float = 0.0

    @property
    def num_cases(self) -> int:
        return sum(self.statuses.values())

    def by_status(self) -> dict[int, int]:
        counts: Counter = Counter()
        for (_, status), n in self.statuses.items():
            counts[status] += n
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        lines = [f"{self.num_cases} cases in {self.seconds:.1f} s; by status: {self.by_status()}"]
        for label in sorted({label for label, _ in self.statuses}):
            per = {status: n for (lab, status), n in sorted(self.statuses.items()) if lab == label}
            lines.append(f"  {label}: {per}")
        lines += [f"  FAILURE {line}" for line in self.failures]
        return "\n".join(lines)


def bound_work(case) -> None:
    """Lower what a generated request asks the engine to do: at most MAX_TOKENS tokens per choice."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
        value = body.get(key)
        if type(value) is int and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if case.path == "/v1/chat/completions" and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_TOKENS  # else the default is the rest of the context
    if case.path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_TOKENS


NOT_FUZZED = {("POST", "/sleep"), ("POST", "/wake_up")}
"""Development routes that change the whole server's state (a sleep pauses every request until a wake-up)."""


def _operations(schema) -> list:
    operations = [result.ok() for result in schema.get_all_operations()]
    return [op for op in operations if (op.method.upper(), op.path) not in NOT_FUZZED]


def _takes_input(operation) -> bool:
    return bool(len(operation.body) or any(len(part) for part in (operation.query, operation.headers,
                                                                   operation.path_parameters, operation.cookies)))


def _budgets(operations, num_cases: int) -> list[tuple[object, int]]:
    """Cases per operation: one for each operation that takes no input (every case of it is the same request),
    the rest shared by WEIGHTS (operations not named there share what WEIGHTS leaves)."""
    fixed = [op for op in operations if not _takes_input(op)]
    weighted = [op for op in operations if _takes_input(op)]
    unnamed = [op for op in weighted if (op.method.upper(), op.path) not in WEIGHTS]
    left = max(0.0, 1.0 - sum(WEIGHTS.values()))
    weights = {id(op): WEIGHTS.get((op.method.upper(), op.path), left / max(1, len(unnamed))) for op in weighted}
    total_weight = sum(weights.values()) or 1.0
    rest = max(len(weighted), num_cases - len(fixed))
    return [(op, 1) for op in fixed] + [(op, max(1, round(rest * weights[id(op)] / total_weight)))
                                        for op in weighted]


def fuzz(base_url: str, num_cases: int, headers: dict[str, str] | None = None, seed: int | None = None,
         timeout_s: float = 60.0, progress: bool = False) -> FuzzResult:
    """Send `num_cases` generated requests (positive and negative, about half each) to the server at base_url
    and count the answers."""
    headers = dict(headers or {})
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers, timeout=30)
    result = FuzzResult()
    session = requests.Session()
    start = time.monotonic()
    for operation, budget in _budgets(_operations(schema), num_cases):
        _fuzz_operation(operation, budget, base_url, session, headers, seed, timeout_s, result)
        if progress:
            label = f"{operation.method.upper()} {operation.path}"
            print(f"{label}: {sum(n for (lab, _), n in result.statuses.items() if lab == label)} cases, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
    session.close()
    result.seconds = time.monotonic() - start
    return result


def _fuzz_operation(operation, budget: int, base_url: str, session, headers: dict[str, str], seed: int | None,
                    timeout_s: float, result: FuzzResult) -> None:
    label = f"{operation.method.upper()} {operation.path}"
    strategy = st.one_of(operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                         operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))

    @settings(max_examples=budget, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def send(case):
        bound_work(case)
        try:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=timeout_s)
        except requests.RequestException as e:
            result.statuses[(label, "error")] += 1
            result.failures.append(f"{label}: {type(e).__name__}: {e}; {_curl(case, headers)}")
            return
        result.statuses[(label, response.status_code)] += 1
        if response.status_code >= 500 and response.status_code != 503:
            result.failures.append(f"{label}: {response.status_code} {response.text[:300]!r}; "
                                   f"{_curl(case, headers)}")

    if seed is not None:
        send = hypothesis_seed(seed)(send)
    send()


def _curl(case, headers: dict[str, str]) -> str:
    try:
        return case.as_curl_command(headers=headers)
    except Exception:  # the command is a convenience; never hide the failure behind it
        return f"body={json.dumps(case.body, default=str)[:300]}"


def server_intact(base_url: str, engine_pid: int, headers: dict[str, str] | None = None) -> list[str]:
    """The checks after a fuzz run: the same engine process, /health 200, a valid request answered."""
    failures = []
    with httpx.Client(base_url=base_url, timeout=30, headers=headers or {}) as http:
        pid = http.get("/debug/kv_cache").json().get("engine_pid")
        if pid != engine_pid:
            failures.append(f"engine pid {pid} != {engine_pid}: the engine restarted")
        health = http.get("/health").status_code
        if health != 200:
            failures.append(f"/health is {health}")
        model = http.get("/v1/models").json()["data"][0]["id"]
        ok = http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2})
        if ok.status_code != 200:
            failures.append(f"a valid request after the fuzz got {ok.status_code}: {ok.text[:200]}")
    return failures




def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--url", default=None, help="fuzz this running server instead of starting one")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--log-dir", default=None, help="the server's log (default: a temporary folder)")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    server = None
    if args.url is None:
        from reliability_utils import Server

        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedllm-fuzz-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"server log in {log_dir}", flush=True)
        server = Server(build_tiny_model(log_dir / "model"), log_dir / "server.log", *extra, api_key=args.api_key,
                        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        url = server.url
    else:
        url = args.url.rstrip("/")
    try:
        engine_pid = httpx.get(url + "/debug/kv_cache", headers=headers, timeout=30).json()["engine_pid"]
        result = fuzz(url, args.cases, headers, args.seed, progress=True)
        failures = result.failures + server_intact(url, engine_pid, headers)
        if server is not None:
            if server.proc.poll() is not None:
                failures.append(f"the server exited with {server.proc.returncode}")
            failures += [f"server log: {line}" for line in log_alarms(server.log())][:20]
    finally:
        if server is not None:
            server.close()
    print(result.summary())
    print("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({
            "command": sys.argv, "cases": result.num_cases, "seconds": round(result.seconds, 1),
            "by_status": result.by_status(),
            "by_operation": {f"{label} {status}": n for (label, status), n in sorted(result.statuses.items(),
                                                                                       key=str)},
            "failures": failures, "loadavg_end": os.getloadavg()}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
