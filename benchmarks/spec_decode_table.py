"""The table of a speculative-decoding sitting (benchmarks/spec_decode_sitting.sh): per engine and workload, the
median output tok/s over the runs (with the runs), the ratio to the same engine family with speculation off, and
the acceptance figures from the server's /metrics counters.

    python benchmarks/spec_decode_table.py /tmp/pagedllm-spec-sitting
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
_NAME = re.compile(r"^(?P<engine>.+?)-(?P<dataset>copy-heavy|random)-c(?P<c>\d+)-run(?P<run>\d+)\.json$")


def counters(path: Path) -> dict[str, float]:
    """The speculative-decoding counters of a /metrics scrape, summed over their labels (0 when absent)."""
    totals = dict.fromkeys(_COUNTERS, 0.0)
    if not path.exists():
        return totals
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            continue
        for name in _COUNTERS:
            if re.match(re.escape(name) + r"(_total)?[{ ]", line):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def main(out: Path) -> None:
    rows: dict[tuple[str, str, int], dict] = defaultdict(lambda: {"rates": [], "drafts": 0.0, "draft_tokens": 0.0,
                                                                  "accepted": 0.0})
    for f in sorted(out.glob("*.json")):
        m = _NAME.match(f.name)
        if not m:
            continue
        row = rows[(m["engine"], m["dataset"], int(m["c"]))]
        row["rates"].append(json.loads(f.read_text())["output_throughput"])
        stem = f.name[:-len(".json")]
        before, after = counters(out / f"{stem}.metrics-before"), counters(out / f"{stem}.metrics-after")
        delta = {k: after[k] - before[k] for k in _COUNTERS}
        row["drafts"] += delta[_COUNTERS[0]]
        row["draft_tokens"] += delta[_COUNTERS[1]]
        row["accepted"] += delta[_COUNTERS[2]]
    print("| engine | workload | output tok/s (median; runs) | vs same engine, speculation off | acceptance rate "
          "| mean acceptance length |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (engine, dataset, c), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        median = statistics.median(row["rates"])
        off = rows.get((engine.rsplit("-", 1)[0] + "-off", dataset, c))
        ratio = f"{median / statistics.median(off['rates']):.2f}x" if off and not engine.endswith("-off") else "-"
        if row["draft_tokens"]:
            rate = f"{row['accepted'] / row['draft_tokens']:.3f}"
            length = f"{1 + row['accepted'] / row['drafts']:.2f}"
        else:
            rate = length = "-"
        runs = ", ".join(f"{r:.1f}" for r in row["rates"])
        print(f"| {engine} | {dataset} c{c} | {median:.1f} ({runs}) | {ratio} | {rate} | {length} |")
    failed = sorted(p.name for p in out.glob("*-failed-run*"))
    if failed:
        print(f"\nDid not start: {', '.join(failed)} (see {out}/logs).")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
