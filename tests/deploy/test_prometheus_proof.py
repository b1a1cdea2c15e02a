"""deploy/prometheus/prove.py, slim: a real `pagedllm serve` of the tiny model (one engine, ngram
speculation) under a small load of the repo's bench client, scraped by a real Prometheus that loads alerts.yaml;
every dashboard query returns data (the speculative panels may be 0 / 0 here: see the test), every recording rule
a value, every alert's selectors match real series."""

from __future__ import annotations

import os
import shutil

import pytest
from deploy_files import load_script

pytestmark = pytest.mark.slow
SPEC_PANELS = {"Draft acceptance rate", "Mean acceptance length", "Acceptance by draft position"}


def test_dashboard_and_alerts_against_a_real_prometheus(tiny_llama_dir, tmp_path):
    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing in CI: scripts/setup.sh installs Debian's prometheus package")
        pytest.skip("prometheus not found (apt-get install prometheus)")
    prove = load_script("prometheus/prove.py")
    flags = ["--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "64MiB",
             "--speculative-config",
             '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}',
             "--uvicorn-log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    report = prove.prove(str(tiny_llama_dir), flags, num_prompts=6, concurrency=3, output_len=16, workdir=tmp_path,
                         scrape_s=0.5, rate_window="10s",
                         bench_flags=["--tokenizer", str(tiny_llama_dir)], env=env, server_timeout=120)
    print(report.timings)
    # The tiny random model's outputs rarely repeat its prompt, so in a 1-second load n-gram speculation may draft
    # nothing: the acceptance panels then have series but no finite value (0 / 0). They must still exist here;
    # deploy/prometheus/prove.py with SmolLM2 on the copy-heavy dataset shows them with data (benchmarks/RESULTS.md).
    failed = [c for c in report.checks if not c.ok and not (c.name in SPEC_PANELS and "no finite value" in c.detail)]
    assert report.checks and not failed, report.table()
    kinds = {c.kind for c in report.checks}
    assert {"panel", "recording rule", "alert", "rules API", "alert condition"} <= kinds
