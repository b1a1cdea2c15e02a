import numpy as np
import pytest

from pagedllm.bench.metrics import calculate_metrics, peak_rates, percentile_stats, percentile_word
from pagedllm.bench.request_func import RequestFuncOutput
from pagedllm.bench.serve import arrival_offsets, parse_goodput


def _out(start, ttft, itl, output_tokens=None, prompt_len=10, success=True, text=""):
    return RequestFuncOutput(generated_text=text, success=success, latency=ttft + sum(itl),
                             output_tokens=len(itl) + 1 if output_tokens is None else output_tokens,
                             ttft=ttft, itl=list(itl), prompt_len=prompt_len, start_time=start)


def test_ttft_tpot_itl_e2el_on_synthetic_timings():
    outputs = [
        _out(0.0, 0.100, [0.010, 0.020, 0.030]),  # 4 tokens, E2EL 0.160, TPOT 0.060 / 3 = 0.020
        _out(0.5, 0.300, [0.040]),  # 2 tokens, E2EL 0.340, TPOT 0.040
        _out(0.7, 0.200, [], output_tokens=1),  # 1 token: no TPOT, no ITL
        _out(0.9, 0.0, [], success=False, prompt_len=99),
    ]
    metrics, output_lens = calculate_metrics(outputs, dur_s=2.0)
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert output_lens == [4, 2, 1, 0]
    assert metrics.total_input == 30 and metrics.total_output == 7
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.output_throughput == pytest.approx(3.5)
    assert metrics.total_token_throughput == pytest.approx(18.5)
    assert metrics.samples_s["ttft"] == pytest.approx([0.1, 0.3, 0.2])
    assert metrics.samples_s["tpot"] == pytest.approx([0.02, 0.04])
    assert metrics.samples_s["itl"] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert metrics.samples_s["e2el"] == pytest.approx([0.16, 0.34, 0.2])
    ttft = percentile_stats(metrics.samples_s["ttft"], [50, 99])
    assert ttft["mean"] == pytest.approx(200.0)
    assert ttft["median"] == pytest.approx(200.0)
    assert ttft["std"] == pytest.approx(np.std([100, 300, 200]))
    assert ttft["p99"] == pytest.approx(298.0)  # linear interpolation between 200 and 300
    assert ttft["p50"] == pytest.approx(200.0)


def test_output_length_falls_back_to_the_tokenizer(bpe_tokenizer):
    text = "the quick brown fox jumps"
    outputs = [_out(0.0, 0.1, [0.01, 0.01], output_tokens=0, text=text)]
    _, output_lens = calculate_metrics(outputs, 1.0, bpe_tokenizer)
    assert output_lens == [len(bpe_tokenizer(text, add_special_tokens=False).input_ids)]
    _, no_tokenizer = calculate_metrics(outputs, 1.0, None)
    assert no_tokenizer == [1]


def test_empty_samples_report_zero():
    metrics, _ = calculate_metrics([_out(0.0, 0.0, [], success=False)], 1.0)
    assert metrics.completed == 0
    assert percentile_stats(metrics.samples_s["ttft"], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0,
                                                                 "p99": 0.0}


def test_goodput_counts_requests_within_every_objective():
    outputs = [_out(0, 0.1, [0.01] * 3), _out(0, 0.5, [0.01] * 3), _out(0, 0.1, [0.2] * 3)]
    metrics, _ = calculate_metrics(outputs, 2.0, goodput_slos_ms=parse_goodput(["ttft:200", "tpot:50"]))
    assert metrics.request_goodput == pytest.approx(0.5)  # only the first meets both
    with pytest.raises(ValueError):
        parse_goodput(["ttft=200"])


def test_peak_rates_buckets_tokens_and_active_requests():
    outputs = [
        _out(10.0, 0.2, [0.3, 0.3]),  # tokens at 0.2, 0.5, 0.8 -> bucket 0; active in bucket 0
        _out(10.9, 0.05, [0.1, 0.1, 0.1]),  # tokens at 0.95 (bucket 0), 1.05, 1.15, 1.25 (bucket 1)
        _out(12.5, 0.1, []),  # token at 2.6; active in bucket 2 only
    ]
    max_tokens, max_active = peak_rates(outputs)
    assert max_tokens == 4.0  # bucket 0: three + one
    assert max_active == 2  # buckets 0 and 1 both hold two requests
    assert peak_rates([]) == (0.0, 0)


def test_arrival_offsets():
    assert arrival_offsets(3, float("inf"), 1.0, np.random.RandomState(0)) == [0.0, 0.0, 0.0]
    poisson = arrival_offsets(50, 10.0, 1.0, np.random.RandomState(1))
    assert poisson[-1] == pytest.approx(5.0)  # scaled so the last leaves at n / rate
    assert poisson == sorted(poisson)
    assert poisson == arrival_offsets(50, 10.0, 1.0, np.random.RandomState(1))
    uniform = arrival_offsets(4, 2.0, float("inf"), np.random.RandomState(0))
    assert uniform == pytest.approx([0.5, 1.0, 1.5, 2.0])
    gaps_bursty = np.diff(arrival_offsets(400, 10.0, 0.2, np.random.RandomState(2)))
    gaps_even = np.diff(arrival_offsets(400, 10.0, 5.0, np.random.RandomState(2)))
    assert np.std(gaps_bursty) > 2 * np.std(gaps_even)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0, np.random.RandomState(0))


def test_percentile_word():
    assert percentile_word(99.0) == "99"
    assert percentile_word(99.9) == "99.9"
