"""`pagedllm plan`: the bounds' arithmetic, the CLI, and agreement with the discrete-event simulation.

The simulation tests build a synthetic machine (LinearStepModel), "measure" it as `bench serve --max-concurrency C`
would (closed-loop simulation -> result dicts), plan from those measurements, then simulate Poisson traffic at the
plan's recommendation (SLOs met) and with one replica fewer (missed), for a workload bound by each bound in turn.
"""

from __future__ import annotations

import json
import math

import pytest

from pagedllm.bench.plan import Memory, Workload, p99_wait_s, plan, wait_probability
from pagedllm.bench.plan_curve import BenchPoint, Curve, PlanError, point_from_result
from pagedllm.bench.plan_itl import p99_itl_poisson_ms, prefill_count_distribution
from pagedllm.bench.plan_sim import LinearStepModel, as_bench_result, meets, simulate
from pagedllm.entrypoints.cli.main import main

MACHINE = LinearStepModel(base_s=0.010, per_seq_s=0.002, prefill_per_token_s=0.0001)
PROMPT, OUTPUT = 128, 32


def _point(c: int, p99_itl: float, mean_itl: float, p99_ttft: float = 100.0, mean_ttft: float = 50.0) -> BenchPoint:
    return BenchPoint(concurrency=c, request_throughput=1.0, output_throughput=32.0, mean_ttft_ms=mean_ttft,
                      p99_ttft_ms=p99_ttft, mean_itl_ms=mean_itl, p99_itl_ms=p99_itl, mean_input_len=PROMPT,
                      mean_output_len=OUTPUT)


# ITL p99 20 ms at batch 1 up to 100 ms at 16; service time S(b) = 0.05 + 31 x mean ITL(b)
CURVE = Curve([_point(1, 20, 10), _point(4, 40, 20), _point(16, 100, 50, p99_ttft=400, mean_ttft=200)])
BIG = Memory(kv_bytes_per_token=1000, kv_memory_per_replica=10**9)


def _workload(users: float = 60, ttft: float = 5000, itl: float = 200, **kw) -> Workload:
    return Workload(users, 10, PROMPT, OUTPUT, ttft, itl, **kw)


def test_curve_interpolates_holds_below_and_refuses_above():
    assert CURVE.at("p99_itl_ms", 1) == 20
    assert CURVE.at("p99_itl_ms", 2) == pytest.approx(20 + 20 / 3)
    assert CURVE.at("p99_itl_ms", 10) == pytest.approx(70)
    one = Curve([_point(8, 60, 30)])
    assert one.at("p99_itl_ms", 1) == one.at("p99_itl_ms", 8) == 60  # one file: its figures below its concurrency
    with pytest.raises(PlanError, match="above the largest measured concurrency 8"):
        one.at("p99_itl_ms", 9)


def test_arrival_rate_and_littles_law():
    result = plan(_workload(users=60), CURVE, BIG)  # 60 users x 10 / minute = 10 req/s
    little = result.bounds["littles_law"]
    assert little["concurrent"] == pytest.approx(10 * little["service_time_s"])
    assert little["concurrent"] == pytest.approx(little["batch_per_replica"] * result.replicas)
    assert little["headroom"] == pytest.approx(1 - little["concurrent"] / (result.replicas * result.max_num_seqs))


def test_itl_slo_binds_max_num_seqs_at_the_replicas_arrival_rate():
    # a prefill adds mean TTFT - mean ITL at batch 1 = 40 ms; how many join a step depends on lambda / replicas
    result = plan(_workload(itl=70), CURVE, BIG)  # 10 req/s
    m, rate = result.max_num_seqs, 10 / result.replicas
    assert result.binding["max_num_seqs"] == "itl_slo"
    assert CURVE.p99_itl_open_ms(m, PROMPT, rate) <= 70 < CURVE.p99_itl_open_ms(m + 1, PROMPT, rate)
    assert result.bounds["itl_slo"]["replica_arrival_rate"] == pytest.approx(rate)
    # at a trickle fewer prefills share a step: a larger batch meets the same SLO
    assert plan(_workload(users=0.01, itl=70), CURVE, BIG).max_num_seqs > m
    # the measured p99 binds where it is the larger: a curve whose batch-1 TTFT has no prefill to add
    no_prefill = Curve([_point(1, 20, 10, mean_ttft=10), _point(16, 100, 50, mean_ttft=10)])
    assert plan(_workload(itl=60), no_prefill, BIG).max_num_seqs == 8  # p99 ITL(8) = 20 + 80 x 7 / 15 < 60


@pytest.mark.parametrize("rate, prefills_at_p99", [(1, 1), (2, 1), (4, 2), (6, 3)])
def test_p99_itl_counts_the_prefills_poisson_arrivals_put_in_a_step(rate, prefills_at_p99):
    """The analytic tail (bench/plan_itl.py, a Markov chain) against the event simulation (bench/plan_sim.py,
    which admits every waiting request at a step's start): a machine whose decode step is 40 ms at any batch and
    whose prefill is 64 ms; the old heuristic (mean ITL + one prefill, 104 ms) under-counts from 4 req/s."""
    machine = LinearStepModel(base_s=0.040, per_seq_s=0.0, prefill_per_token_s=0.0005)
    sim = simulate(machine, replicas=1, max_num_seqs=1000, prompt_len=PROMPT, output_len=OUTPUT, arrival_rate=rate,
                   num_requests=2000, seed=1)
    assert p99_itl_poisson_ms(rate, 40, 64) == pytest.approx(40 + 64 * prefills_at_p99)
    assert sim["p99_itl_ms"] == pytest.approx(40 + 64 * prefills_at_p99)
    assert sum(prefill_count_distribution(rate, 0.040, 0.064)) == pytest.approx(1)
    assert p99_itl_poisson_ms(0, 40, 64) == 40 and p99_itl_poisson_ms(1 / 0.064, 40, 64) == math.inf


def test_measured_range_binds_when_every_batch_meets_the_slo():
    result = plan(_workload(itl=500), CURVE, BIG)
    assert result.max_num_seqs == 16 and result.binding["max_num_seqs"] == "measured_range"
    assert any("largest measured concurrency" in w for w in result.warnings)


def test_ttft_before_queueing_binds_max_num_seqs():
    result = plan(_workload(users=1, ttft=250, itl=500), CURVE, BIG)  # p99 TTFT 100 at <= 4, 400 at 16
    assert result.binding["max_num_seqs"] == "ttft_slo" and result.max_num_seqs == 10


def test_memory_binds_max_num_seqs_and_sizes_the_kv_cache():
    per_seq = 10 * 16 * 1000  # 160 tokens = 10 blocks of 16
    result = plan(_workload(itl=500), CURVE, Memory(1000, 5 * per_seq + 1))
    assert result.max_num_seqs == 5 and result.binding["max_num_seqs"] == "memory"
    assert result.kv_cache_memory_bytes == 5 * per_seq and result.num_blocks == 50
    assert result.bounds["memory"]["headroom"] == pytest.approx(1 / (5 * per_seq + 1))
    floor = plan(_workload(itl=500), CURVE, Memory(1000, 10**9, max_model_len=4096))  # one 4096-token sequence
    assert floor.num_blocks == 256 and floor.kv_cache_memory_bytes == 4096 * 1000
    with pytest.raises(PlanError, match="160 tokens \\(prompt \\+ output\\) is longer than --max-model-len 100"):
        plan(_workload(itl=500), CURVE, Memory(1000, 10**9, max_model_len=100))
    with pytest.raises(PlanError, match="--max-model-len 4096 tokens needs 4096000 bytes"):
        plan(_workload(itl=500), CURVE, Memory(1000, 10**6, max_model_len=4096))
    ranged = plan(_workload(itl=500, len_range_ratio=0.5), CURVE, Memory(1000, 10**9))  # sized for 240 tokens
    assert ranged.bounds["memory"]["kv_bytes_per_sequence"] == 15 * 16 * 1000


def test_throughput_binds_replicas():
    result = plan(_workload(users=500), CURVE, BIG)  # 83.3 req/s
    m = result.max_num_seqs
    capacity = m / CURVE.service_time_s(m, OUTPUT)
    assert result.replicas == math.floor(500 / 6 / capacity) + 1 and result.binding["replicas"] == "throughput"
    assert result.bounds["throughput"]["headroom"] == pytest.approx(1 - 500 / 6 / (result.replicas * capacity))


def test_queueing_binds_replicas_when_the_ttft_slo_is_tight():
    loose = plan(_workload(users=500), CURVE, BIG)
    tight = plan(_workload(users=500, ttft=420), CURVE, BIG)
    assert tight.binding["replicas"] == "ttft_queueing" and tight.replicas > loose.replicas
    assert tight.bounds["ttft_slo"]["p99_ttft_ms_predicted"] <= 420


def test_wait_probability_matches_mm1_and_limits():
    def constant(b: int) -> float:
        return 0.5
    assert wait_probability(1.0, constant, 1) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert wait_probability(1e-9, constant, 4) == pytest.approx(0, abs=1e-9)
    assert wait_probability(10, constant, 4) == 1.0 and p99_wait_s(10, constant, 4) == math.inf
    # M/M/1 p99 wait: ln(rho / 0.01) / (mu - lambda); deterministic service halves it
    assert p99_wait_s(1.0, constant, 1) == pytest.approx(math.log(50) / 1.0)
    assert p99_wait_s(1.0, constant, 1, service_cv2=0) == pytest.approx(math.log(50) / 2)


@pytest.mark.parametrize("workload, memory, message", [
    (_workload(itl=10), BIG, "ITL SLO 10 ms is below the p99 ITL at batch 1, 20.0 ms \\(measured, or mean ITL"),
    (_workload(ttft=50), BIG, "TTFT SLO 50 ms is below the p99 TTFT at batch 1, 100.0 ms \\(measured\\)"),
    (_workload(), Memory(1000, 1000), "one sequence of up to 160 tokens needs 160000 bytes"),
    (_workload(users=0), BIG, "--users must be positive"),
])
def test_impossible_inputs_are_refused_with_a_reason(workload, memory, message):
    with pytest.raises(PlanError, match=message):
        plan(workload, CURVE, memory)


def test_smallest_measured_concurrency_above_one_says_measure_smaller():
    with pytest.raises(PlanError, match="smallest measured concurrency 4 \\(measure smaller ones\\)"):
        plan(_workload(itl=30), Curve([_point(4, 40, 20)]), BIG)


def test_bench_result_needs_concurrency_and_p99():
    good = {"max_concurrency": 2, "completed": 4, "request_throughput": 1.0, "output_throughput": 32.0,
            "mean_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "mean_itl_ms": 1.0, "p99_itl_ms": 2.0,
            "total_input_tokens": 400, "total_output_tokens": 128}
    assert point_from_result(good).mean_input_len == 100
    with pytest.raises(PlanError, match="without --max-concurrency"):
        point_from_result({**good, "max_concurrency": None}, "x.json")
    with pytest.raises(PlanError, match="x.json: no p99_itl_ms"):
        point_from_result({k: v for k, v in good.items() if k != "p99_itl_ms"}, "x.json")


def _measured(tmp_path) -> list[str]:
    """The synthetic machine measured like a `bench serve` sweep: closed loop at C = 1..32, as result files."""
    paths = []
    for c in (1, 2, 4, 8, 16, 32):
        sim = simulate(MACHINE, replicas=1, max_num_seqs=c, prompt_len=PROMPT, output_len=OUTPUT, concurrency=c,
                       num_requests=max(100, 8 * c))
        path = tmp_path / f"c{c}.json"
        path.write_text(json.dumps(as_bench_result(sim, c, PROMPT, OUTPUT)))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("name, users, itl_slo, kv_memory, binding", [
    ("throughput-bound", 450, 200, 10**9, "measured_range"),  # 15 req/s, every measured batch meets the ITL SLO
    ("memory-bound", 300, 200, 6 * 160_000, "memory"),  # room for 6 sequences of 160 tokens
    ("ITL-bound", 300, 40, 10**9, "itl_slo"),  # p99 ITL at batch 8 just under 40 ms
])
def test_simulation_meets_slos_at_the_plan_and_misses_them_with_one_replica_fewer(
        tmp_path, name, users, itl_slo, kv_memory, binding):
    from pagedllm.bench.plan_curve import load_points

    workload = Workload(users, 2, PROMPT, OUTPUT, ttft_slo_ms=2000, itl_slo_ms=itl_slo)
    result = plan(workload, Curve(load_points(_measured(tmp_path))), Memory(1000, kv_memory))
    assert result.binding["max_num_seqs"] == binding and result.replicas >= 2, result.reasoning

    def run(replicas: int) -> dict:
        return simulate(MACHINE, replicas=replicas, max_num_seqs=result.max_num_seqs, prompt_len=PROMPT,
                        output_len=OUTPUT, arrival_rate=workload.arrival_rate, num_requests=1500, seed=1)

    at_plan, fewer = run(result.replicas), run(result.replicas - 1)
    assert meets(at_plan, workload.ttft_slo_ms, workload.itl_slo_ms), (name, at_plan)
    assert not meets(fewer, workload.ttft_slo_ms, workload.itl_slo_ms), (name, fewer)


def test_simulation_is_seeded():
    kw = dict(replicas=2, max_num_seqs=4, prompt_len=PROMPT, output_len=OUTPUT, arrival_rate=5.0, num_requests=200,
              len_range_ratio=0.3)
    assert simulate(MACHINE, seed=3, **kw) == simulate(MACHINE, seed=3, **kw)
    assert simulate(MACHINE, seed=3, **kw) != simulate(MACHINE, seed=4, **kw)


def test_cli_prints_the_plan_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--users", "300", "--requests-per-user-per-minute", "2", "--prompt-len", str(PROMPT),
            "--output-len", str(OUTPUT), "--ttft-slo-ms", "2000", "--itl-slo-ms", "40", "--kv-bytes-per-token",
            "1000", "--kv-memory-per-replica", "1GiB", "--bench-result", *_measured(tmp_path),
            "--output-json", str(out), "--simulate"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Recommendation: 2 replica(s), each `--max-num-seqs 8 --kv-cache-memory-bytes 1280000`" in text
    for line in ("Little's law: ", "throughput: ", "memory: ", "ITL SLO: ", "TTFT SLO: ", "Method:"):
        assert line in text
    assert "2 replica(s): p99 TTFT" in text and "SLOs met" in text and "SLOs MISSED" in text
    data = json.loads(out.read_text())
    assert data["replicas"] == 2 and data["max_num_seqs"] == 8 and data["workload"]["arrival_rate"] == 10
    assert set(data["bounds"]) == {"itl_slo", "ttft_slo", "memory", "throughput", "littles_law"}
    assert [run["meets_slos"] for run in data["simulation"]] == [True, False]


def test_cli_reports_impossible_slo(tmp_path, capsys):
    args = ["plan", "--users", "10", "--requests-per-user-per-minute", "1", "--prompt-len", "128", "--output-len",
            "32", "--ttft-slo-ms", "2000", "--itl-slo-ms", "1", "--kv-bytes-per-token", "1000",
            "--bench-result", *_measured(tmp_path)[:2]]
    assert main(args) == 1
    assert "error: ITL SLO 1 ms is below the p99 ITL at batch 1" in capsys.readouterr().err


def test_cli_reads_kv_bytes_per_token_from_the_model_config(tmp_path, capsys, tiny_llama_dir):
    args = ["plan", "--users", "10", "--requests-per-user-per-minute", "1", "--prompt-len", "128", "--output-len",
            "32", "--ttft-slo-ms", "5000", "--itl-slo-ms", "500", "--model", str(tiny_llama_dir),
            "--dtype", "float32", "--bench-result", *_measured(tmp_path)[:2]]
    assert main(args) == 0
    assert "x 4 B (float32) = " in capsys.readouterr().out
