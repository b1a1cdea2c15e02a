"""The scheduler's side of the KV connector seam (core/kv_connector.py), with a scripted connector: what the
scheduler does with synchronous and asynchronous loads, delayed frees and failed loads."""

from __future__ import annotations

from tests.core.utils import create_requests, make_output

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages import FinishReason, KVConnectorOutput, ModelRunnerOutput

BLOCK = 16


class ScriptedConnector:
    """Answers get_num_new_matched_tokens from `external` (req id -> (tokens, async)); records the calls."""

    def __init__(self, external=None, delay=False, policy="recompute"):
        self.external = external or {}
        self.delay = delay
        self.kv_load_failure_policy = policy
        self.allocs: dict[str, tuple[list[int], int]] = {}
        self.finished: list[str] = []
        self.metas = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.external.get(request.request_id, (0, False))

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs[request.request_id] = (list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        self.metas += 1
        return {"step": self.metas}

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return self.delay, ({"remote_block_ids": block_ids} if self.delay else None)

    def update_connector_output(self, connector_output):
        pass


def _scheduler(connector, num_blocks=64):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), CacheConfig(block_size=BLOCK),
                     num_blocks, 512, kv_connector=connector)


def _apply(scheduler, out, kv_output=None):
    runner_output = make_output(scheduler, out)
    runner_output.kv_connector_output = kv_output
    return scheduler.update_from_output(out, runner_output)


def test_synchronous_load_counts_external_tokens_computed_and_keeps_the_last_token():
    connector = ScriptedConnector({"0": (64, False)})
    scheduler = _scheduler(connector)
    (request,) = create_requests(1, num_tokens=64)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.kv_connector_metadata == {"step": 1}
    assert out.num_scheduled_tokens == {"0": 1}  # 63 loaded (the last token is never loaded), 1 computed
    assert out.scheduled_new_reqs[0].num_computed_tokens == 63
    block_ids, num_external = connector.allocs["0"]
    assert num_external == 63 and len(block_ids) == 4
    eo = _apply(scheduler, out)
    assert eo.outputs[0].new_token_ids == [0]
    assert scheduler.kv_transfer.external_hits == 63


def test_asynchronous_load_waits_without_blocking_the_step_then_runs_its_last_token():
    connector = ScriptedConnector({"0": (48, True)})
    scheduler = _scheduler(connector)
    loading, other = create_requests(2, num_tokens=48)
    scheduler.add_request(loading)
    scheduler.add_request(other)
    out = scheduler.schedule()
    assert loading.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(out.num_scheduled_tokens) == ["1"]  # the other request runs meanwhile
    assert len(scheduler.kv_cache_manager.get_block_ids("0")) == 3  # its blocks are held while it loads
    _apply(scheduler, out)
    out = scheduler.schedule()
    assert "0" not in out.num_scheduled_tokens
    _apply(scheduler, out, KVConnectorOutput(finished_recving={"0"}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["0"] == 1 and loading.status == RequestStatus.RUNNING
    assert out.scheduled_new_reqs[0].num_computed_tokens == 47


def test_delayed_free_keeps_blocks_until_sent_and_returns_kv_transfer_params():
    connector = ScriptedConnector(delay=True)
    scheduler = _scheduler(connector)
    (request,) = create_requests(1, num_tokens=40, max_tokens=1)
    scheduler.add_request(request)
    free_before = scheduler.num_free_blocks
    out = scheduler.schedule()
    eo = _apply(scheduler, out)
    assert eo.outputs[0].finish_reason == FinishReason.LENGTH
    assert eo.outputs[0].kv_transfer_params == {"remote_block_ids": scheduler.kv_cache_manager.get_block_ids("0")}
    assert scheduler.num_free_blocks == free_before - 3 and scheduler.has_unfinished_requests()
    _apply(scheduler, scheduler.schedule(), KVConnectorOutput(finished_sending={"0"}))
    assert scheduler.num_free_blocks == free_before and not scheduler.has_unfinished_requests()


def test_abort_during_a_load_frees_the_blocks_only_when_the_load_ends():
    connector = ScriptedConnector({"0": (32, True)})
    scheduler = _scheduler(connector)
    (request,) = create_requests(1, num_tokens=40)
    scheduler.add_request(request)
    free_before = scheduler.num_free_blocks
    _apply(scheduler, scheduler.schedule())
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_free_blocks < free_before  # the workers still write them
    _apply(scheduler, scheduler.schedule(), KVConnectorOutput(finished_recving={"0"}))
    assert scheduler.num_free_blocks == free_before and not scheduler.has_unfinished_requests()


def test_failed_synchronous_load_recomputes_by_preemption():
    connector = ScriptedConnector({"0": (32, False)})
    scheduler = _scheduler(connector)
    (request,) = create_requests(1, num_tokens=40)
    scheduler.add_request(request)
    out = scheduler.schedule()
    bad = scheduler.kv_cache_manager.get_block_ids("0")[1]
    eo = _apply(scheduler, out, KVConnectorOutput(invalid_block_ids={bad}))
    assert eo.outputs == [] and request.status == RequestStatus.PREEMPTED  # the step's token read bad KV
    connector.external = {}
    out = scheduler.schedule()
    assert "0" in out.preempted_req_ids and out.num_scheduled_tokens == {"0": 40}


def test_failed_load_under_policy_fail_ends_only_that_request():
    connector = ScriptedConnector({"0": (32, False)}, policy="fail")
    scheduler = _scheduler(connector)
    failing, fine = create_requests(2, num_tokens=40)
    scheduler.add_request(failing)
    scheduler.add_request(fine)
    free_before = scheduler.num_free_blocks
    out = scheduler.schedule()
    bad = scheduler.kv_cache_manager.get_block_ids("0")[0]
    eo = _apply(scheduler, out, KVConnectorOutput(invalid_block_ids={bad}))
    by_id = {o.request_id: o for o in eo.outputs}
    assert by_id["0"].finish_reason == FinishReason.ERROR and "kv_load_failure_policy" in by_id["0"].error
    assert by_id["1"].new_token_ids == [0] and fine.status == RequestStatus.RUNNING
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_free_blocks == free_before


def test_failed_asynchronous_load_resumes_from_the_first_failed_block():
    connector = ScriptedConnector({"0": (48, True)})
    scheduler = _scheduler(connector)
    (request,) = create_requests(1, num_tokens=60)
    scheduler.add_request(request)
    _apply(scheduler, scheduler.schedule())
    bad = scheduler.kv_cache_manager.get_block_ids("0")[2]
    _apply(scheduler, scheduler.schedule(), KVConnectorOutput(finished_recving={"0"}, invalid_block_ids={bad}))
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32 and out.num_scheduled_tokens["0"] == 28


def test_connector_not_ready_keeps_the_request_waiting():
    connector = ScriptedConnector({"0": (None, False)})
    scheduler = _scheduler(connector)
    scheduler.add_request(create_requests(1)[0])
    assert scheduler.schedule().num_scheduled_tokens == {}
    connector.external = {}
    assert scheduler.schedule().num_scheduled_tokens == {"0": 10}


def test_runner_output_without_connector_report_is_fine():
    scheduler = _scheduler(ScriptedConnector())
    scheduler.add_request(create_requests(1)[0])
    out = scheduler.schedule()
    eo = scheduler.update_from_output(out, ModelRunnerOutput(["0"], [[5]]))
    assert eo.outputs[0].new_token_ids == [5]
