"""How constrained JSON outputs end, against a running server: the 23 schemas and json_object of
tests/entrypoints/test_structured_outputs_validity_server.py, at temperature 0 and 0.7, over several seeds, through
response_format. Prints, per temperature, how many finished (`stop`) and validated, how many were cut by max_tokens
(`length`) as a prefix of JSON, and how many broke either rule (with the first few).

    .venv/bin/pagedllm serve --served-model-name tiny --max-model-len 1024 --max-num-seqs 32 &
    .venv/bin/python benchmarks/structured_outputs_endings.py --seeds 3 --max-tokens 120
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

TESTS = Path(__file__).resolve().parents[1] / "tests" / "entrypoints"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # the test module and the helpers it imports
    import test_structured_outputs_validity_server as cases

    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    names = [*cases.SCHEMAS, "json_object0", "json_object1"]
    jobs = [(name, t, i % 2 == 0, seed) for i, name in enumerate(names) for t in cases.TEMPERATURES
            for seed in range(args.seeds)]

    def run(job):
        name, temperature, strict, seed = job
        response_format = ({"type": "json_object"} if name.startswith("json_object") else
                           {"type": "json_schema", "json_schema": {"name": name, "schema": cases.SCHEMAS[name],
                                                                   "strict": strict}})
        what = name.replace("_", " ")
        choice = client.chat.completions.create(
            model=model, max_tokens=args.max_tokens, temperature=temperature, seed=seed,
            messages=[{"role": "user", "content": f"Describe {what} as JSON."}],
            response_format=response_format).choices[0]
        return choice, cases._problems(name, choice)

    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(run, jobs))
    bad = []
    for temperature in cases.TEMPERATURES:
        counts = Counter()
        for job, (choice, problems) in zip(jobs, results, strict=True):
            if job[1] != temperature:
                continue
            counts[_ending(choice, problems)] += 1
            counts["free whitespace"] += any(p.startswith("free whitespace") for p in problems)
            counts["undeclared keys"] += any(p.startswith("keys the schema") for p in problems)
            if problems:
                bad.append((job, problems, choice.message.content[:120]))
        total = sum(counts[k] for k in ("valid", "cut", "invalid"))
        print(f"T={temperature:g}: {counts['valid']}/{total} finished (stop) and valid, {counts['cut']}/{total} cut by "
              f"max_tokens (length) as a JSON prefix, {counts['invalid']}/{total} neither; free whitespace in "
              f"{counts['free whitespace']}, keys the schema does not name in {counts['undeclared keys']}")
    for item in bad[:3]:
        print("broke a rule:", item)
    return 1 if bad else 0


def _ending(choice, problems: list[str]) -> str:
    """valid (stop, parses, validates), cut (length, a JSON prefix) or invalid; whitespace and key rules aside."""
    rules = [p for p in problems if not p.startswith(("free whitespace", "keys the schema"))]
    if rules:
        return "invalid"
    return "valid" if choice.finish_reason == "stop" else "cut"


if __name__ == "__main__":
    sys.exit(main())
