"""Property test: random adds, steps, sampled tokens, finishes and aborts keep the pool consistent.

Drives >= 10,000 random operations in total and checks after every step: no ref_cnt < 0, free queue
holds exactly the ref_cnt-0 blocks, free + in use == total, every hash-map entry points to a block
with that hash, running <= max_num_seqs, scheduled tokens <= budget, the runner's block tables (built
only from SchedulerOutput diffs) match the scheduler's, every request finishes in bounded steps, and
once all are finished or aborted, every block is free with ref_cnt 0 (DESIGN invariant 1).
"""

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core.request import Request, RequestStatus
from pagedllm.messages import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams

from .utils import assert_all_free, check_pool_invariants, create_scheduler

EOS, STOP = 1, 2
OPS_PER_EXAMPLE = 250
MAX_EXAMPLES = 48
PREFIXES = [[3 + (i * 7 + k) % 7 for i in range(64)] for k in range(3)]

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([2, 4]),
    "num_blocks": st.integers(8, 40),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(4, 64),
    "enable_chunked_prefill": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 5]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority", "slo"]),
    "enable_prefix_caching": st.booleans(),
})


class RunnerMirror:
    """The model runner's view: block tables rebuilt only from SchedulerOutput diffs."""

    def __init__(self):
        self.block_tables: dict[str, list[int]] = {}

    def apply(self, output):
        for req_id in output.finished_req_ids | output.preempted_req_ids:
            self.block_tables.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.block_tables
            self.block_tables[new.req_id] = list(new.block_ids)
        cached = output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            self.block_tables[req_id].extend(new_block_ids)


class Driver:
    def __init__(self, cfg, data):
        cfg = dict(cfg)
        max_model_len = min(cfg["num_blocks"] * cfg["block_size"], 48)
        if not cfg["enable_chunked_prefill"]:
            cfg["max_num_batched_tokens"] = max(cfg["max_num_batched_tokens"], max_model_len)
        self.scheduler = create_scheduler(max_model_len=max_model_len, **cfg)
        if cfg["scheduling_policy"] == "slo":  # a clock that moves 0.5 s a reading: ranks age, reproducibly
            ticks = itertools.count()
            self.scheduler.waiting.clock = lambda: 0.5 * next(ticks)
        self.cfg = cfg
        self.data = data
        self.mirror = RunnerMirror()
        self.next_id = 0
        self.age: dict[str, int] = {}
        self.num_finished = 0
        self.step_limit = 8 * max_model_len * (cfg["num_blocks"] + 8)

    def add(self):
        d = self.data
        s = self.scheduler
        length = d.draw(st.integers(1, s.max_model_len))
        prefix = PREFIXES[d.draw(st.integers(0, len(PREFIXES) - 1))]
        shared = d.draw(st.integers(0, length))
        prompt = prefix[:shared] + [3 + (self.next_id * 5 + j) % 11 for j in range(length - shared)]
        params = SamplingParams(
            max_tokens=d.draw(st.sampled_from([None, 1, 3, 8, 20])),
            min_tokens=d.draw(st.sampled_from([0, 0, 1])),
            stop_token_ids=[STOP] if d.draw(st.booleans()) else [],
            ignore_eos=d.draw(st.booleans()),
        )
        request = Request(f"r{self.next_id}", prompt, params, EOS, arrival_time=float(self.next_id),
                          block_size=self.cfg["block_size"], priority=d.draw(st.integers(0, 2)),
                          cache_salt=d.draw(st.sampled_from([None, None, "a", "b"])))
        self.next_id += 1
        s.add_request(request)
        self.age[request.request_id] = 0

    def runner_output(self, output, rng):
        s = self.scheduler
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = s.requests[req_id]
            if request.num_computed_tokens >= request.num_tokens:
                roll = rng.random()
                sampled.append([EOS if roll < 0.08 else STOP if roll < 0.12 else rng.randrange(3, 10)])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def step(self, abort_mid_step=False):
        s = self.scheduler
        rng = random.Random(self.data.draw(st.integers(0, 2**32 - 1)))
        running_before = {r.request_id for r in s.running}
        output = s.schedule()
        self.mirror.apply(output)
        self.check_output(output, running_before)
        runner_output = self.runner_output(output, rng)
        if abort_mid_step and s.requests:
            self.abort(rng.choice(sorted(s.requests)))
        engine_outputs = s.update_from_output(output, runner_output)
        for o in engine_outputs.outputs:
            if o.finished:
                self.age.pop(o.request_id)
                self.num_finished += 1
        for req_id in self.age:
            self.age[req_id] += 1
            assert self.age[req_id] <= self.step_limit, f"{req_id} did not finish in {self.step_limit} steps"
        check_pool_invariants(s)

    def check_output(self, output, running_before):
        s = self.scheduler
        total = sum(output.num_scheduled_tokens.values())
        assert total == output.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert all(n > 0 for n in output.num_scheduled_tokens.values())
        assert len(s.running) <= s.max_num_seqs
        if output.preempted_req_ids:
            assert not output.scheduled_new_reqs  # no admissions in a step that preempted
        assert set(output.scheduled_cached_reqs.req_ids) <= running_before
        for req_id in output.num_scheduled_tokens:
            request = s.requests[req_id]
            block_ids = s.kv_cache_manager.get_block_ids(req_id)
            assert self.mirror.block_tables[req_id] == block_ids
            assert request.num_computed_tokens <= len(block_ids) * s.block_size
            assert request.num_computed_tokens <= request.num_tokens <= s.max_model_len + 1
        check_pool_invariants(s)

    def abort(self, req_id):
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.age.pop(req_id, None)

    def drain(self):
        s = self.scheduler
        for _ in range(self.step_limit):
            if not s.has_unfinished_requests():
                break
            self.step()
        assert not s.has_unfinished_requests(), "requests did not drain"
        self.mirror.apply(s.schedule())  # delivers the last finished ids
        assert not self.mirror.block_tables
        assert_all_free(s)


@pytest.mark.slow  # tens of seconds: out of the fast run (-m "not slow"), still in CI
def test_random_operations_keep_invariants():
    op_counts = {"add": 0, "step": 0, "abort": 0, "abort_mid_step": 0}
    events = {"preemptions": 0, "prefix_hit_tokens": 0, "finished_by_runner": 0}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cfg=configs, data=st.data())
    def run(cfg, data):
        driver = Driver(cfg, data)
        for _ in range(OPS_PER_EXAMPLE):
            op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort", "abort_mid_step"]))
            s = driver.scheduler
            if op == "add":
                cap_ok = len(s.waiting) < 8
                if cap_ok:
                    driver.add()
                else:
                    op = "step"
            if op == "step":
                driver.step()
            elif op == "abort":
                if s.requests:
                    driver.abort(data.draw(st.sampled_from(sorted(s.requests))))
                check_pool_invariants(s)
            elif op == "abort_mid_step":
                driver.step(abort_mid_step=True)
            op_counts[op] += 1
        driver.drain()
        events["preemptions"] += driver.scheduler.num_preemptions
        events["prefix_hit_tokens"] += driver.scheduler.kv_cache_manager.prefix_cache_hits
        events["finished_by_runner"] += driver.num_finished

    run()
    total = sum(op_counts.values())
    print(f"property test ran {total} random operations: {op_counts}; {events}")
    assert total >= 10_000
    assert min(op_counts.values()) > 500
    # The run really preempts, hits the cache and finishes requests. The counts depend on which examples hypothesis
    # generates, and that varies with what ran before in the process (standalone: 149 preemptions; after the whole
    # suite once: 47), so the floor is a coverage check, not a figure.
    assert min(events.values()) > 20
