"""A grammar's mask is computed ahead of its request's step, off the busy loop (issue 32, item 3): while one
request's mask is not ready, the other requests keep getting tokens step after step, and the constrained request
sits those steps out (running, its KV blocks kept) and then ends with the output of its solo run. EngineCore in
process with the tiny model; a mask is made slow by holding the backend's mask fill on an event (steps and
tokens are counted, never time)."""

from __future__ import annotations

import threading
import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.request import RequestStatus
from pagedllm.engine.core import EngineCore
from pagedllm.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams as S
from pagedllm.structured_output.backend_guidance import GuidanceBackend

REGEX = r"[a-c]{3}-[0-9]{4}"
HANG_GUARD_S = 30.0


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    engine = EngineCore(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                                                 num_gpu_blocks_override=32))
    yield engine
    engine.shutdown()


def _add(core: EngineCore, request_id: str, prompt: list[int], constrained: bool, max_tokens: int = 12) -> None:
    params = (SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=S(regex=REGEX))
              if constrained else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    core.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                       eos_token_id=2, arrival_time=time.time()))


def _step(core: EngineCore, tokens: dict[str, list[int]]) -> set[str]:
    """One engine step; returns the requests that got tokens in it."""
    got = set()
    for out in core.step().outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.new_token_ids:
            got.add(out.request_id)
    return got


def _run_to_end(core: EngineCore, tokens: dict[str, list[int]]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "hang guard"
        _step(core, tokens)


def _assert_all_free(core: EngineCore) -> None:
    scheduler = core.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


class _HeldMasks:
    """Holds every mask fill after the first `free` ones until released (a mask that takes as long as the test
    wants)."""

    def __init__(self, monkeypatch, free: int):
        self.release = threading.Event()
        self.calls = 0
        fill = GuidanceBackend.fill_bitmask

        def held_fill(backend, matchers, bitmask):
            self.calls += 1
            if self.calls > free:
                self.release.wait(HANG_GUARD_S)
            fill(backend, matchers, bitmask)

        monkeypatch.setattr(GuidanceBackend, "fill_bitmask", held_fill)


def test_other_requests_keep_stepping_while_a_mask_is_not_ready(core, monkeypatch):
    prompt_c, prompt_u = [5, 6, 7, 8, 9], [10, 11, 12, 13]
    solo: dict[str, list[int]] = {}
    _add(core, "solo", prompt_c, constrained=True)
    _run_to_end(core, solo)
    _assert_all_free(core)

    held = _HeldMasks(monkeypatch, free=1)  # its first mask, then every later one is held
    tokens: dict[str, list[int]] = {}
    _add(core, "c", prompt_c, constrained=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while not tokens.get("c"):  # its grammar compiles, its first mask is computed, it samples one token
        assert time.monotonic() < deadline, "hang guard"
        _step(core, tokens)
    _add(core, "u", prompt_u, constrained=False)
    steps_with_u = 0
    while "u" not in tokens or len(tokens["u"]) < 12:
        assert time.monotonic() < deadline, "hang guard"
        got = _step(core, tokens)
        assert "c" not in got  # its mask is held: it sits every step out
        steps_with_u += "u" in got
    assert steps_with_u == 12  # one token a step, none of them waiting for the held mask
    request = core.scheduler.requests["c"]
    assert request.status == RequestStatus.RUNNING and len(request.output_token_ids) == 1
    assert core.scheduler.kv_cache_manager.get_block_ids("c")  # its KV blocks are kept
    held.release.set()
    _run_to_end(core, tokens)
    assert tokens["c"] == solo["solo"]  # the same greedy output as alone
    _assert_all_free(core)


def test_a_request_alone_waits_for_its_slow_mask(core, monkeypatch):
    """With nothing else to run, the engine waits for the mask (the request always makes progress)."""
    solo: dict[str, list[int]] = {}
    _add(core, "solo2", [20, 21, 22], constrained=True)
    _run_to_end(core, solo)
    held = _HeldMasks(monkeypatch, free=2)
    threading.Timer(0.2, held.release.set).start()  # only to end the wait; nothing counts on when
    tokens: dict[str, list[int]] = {}
    _add(core, "alone", [20, 21, 22], constrained=True)
    _run_to_end(core, tokens)
    assert tokens["alone"] == solo["solo2"]
    _assert_all_free(core)


def test_an_abort_while_the_mask_is_computed(core, monkeypatch):
    held = _HeldMasks(monkeypatch, free=1)
    tokens: dict[str, list[int]] = {}
    _add(core, "gone", [30, 31, 32], constrained=True)
    _add(core, "stays", [33, 34], constrained=False, max_tokens=4)
    deadline = time.monotonic() + HANG_GUARD_S
    while not tokens.get("gone"):
        assert time.monotonic() < deadline, "hang guard"
        _step(core, tokens)
    core.abort_requests(["gone"])  # its next mask is held on the mask thread
    _run_to_end(core, tokens)
    assert len(tokens["stays"]) == 4
    held.release.set()
    _assert_all_free(core)
