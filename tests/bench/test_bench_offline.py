"""`pagedllm bench throughput` and `bench latency` through LLM.generate with the tiny test model."""

import argparse
import json

import pytest

from pagedllm.bench import latency
from pagedllm.bench.engine_args import add_engine_args, engine_kwargs
from pagedllm.entrypoints.cli.main import main

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", str(64 << 20)]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    from pagedllm import LLM

    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=4)


def _args(module, argv):
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


def test_bench_throughput_cli(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama_dir), "--num-prompts", "6", "--input-len", "16",
                 "--output-len", "5", "--num-warmup-prompts", "1", "--max-num-seqs", "4",
                 "--output-json", str(out), *ENGINE_FLAGS]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith("Throughput: ") and "output tokens/s" in stdout
    assert "Total num prompt tokens:  96\nTotal num output tokens:  30" in stdout
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6 and result["total_num_tokens"] == 126
    assert result["tokens_per_second"] == pytest.approx(126 / result["elapsed_time"])


def test_bench_latency(tiny_llm):
    args = _args(latency, ["--batch-size", "2", "--input-len", "8", "--output-len", "6", "--num-iters-warmup", "1",
                           "--num-iters", "2"])
    result = latency.run(args, tiny_llm)
    assert len(result["latencies"]) == 2
    assert list(result["percentiles"]) == [10, 25, 50, 75, 90, 99]
    assert result["median_prefill_latency"] > 0 and result["decode_step_time"] > 0
    text = latency.format_result(result)
    assert text.startswith("Avg latency: ") and "99% percentile latency: " in text and "Decode step time: " in text
    with pytest.raises(ValueError, match="output-len"):
        latency.run(_args(latency, ["--output-len", "1"]), tiny_llm)


def test_engine_flags_reach_the_engine_only_when_given():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([])) == {}
    args = parser.parse_args(["--max-num-seqs", "4", "--no-enable-prefix-caching", "--dtype", "float32"])
    assert engine_kwargs(args) == {"max_num_seqs": 4, "enable_prefix_caching": False, "dtype": "float32"}
