"""DPRouter (engine/dp_router.py), pure Python: the choice rule, the remembered prefixes, the load counts."""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request
from pagedllm.engine.dp_router import SKEW_ABS, DPRouter, choose_replica
from pagedllm.sampling_params import SamplingParams

PREFIX = list(range(100, 164))  # 4 blocks of 16
OTHER = list(range(200, 264))


@pytest.mark.parametrize(("matches", "loads", "alive", "num_blocks", "expected", "why"), [
    ([0, 0], [5, 1], [True, True], 4, 1, "no match: the least loaded"),
    ([0, 0], [3, 3], [True, True], 4, 0, "a tie in load: the lowest rank"),
    ([4, 4], [5, 1], [True, True], 4, 1, "every replica matches as much: no preference, the least loaded"),
    ([4, 0], [8, 1], [True, True], 4, 0, "the longest match, though more loaded"),
    ([2, 3], [0, 4], [True, True], 4, 1, "the longest match wins over a shorter one"),
    ([3, 3, 0], [9, 5, 0], [True, True, True], 4, 1, "among the longest matches, the least loaded"),
    ([1, 0], [8, 0], [True, True], 4, 1, "a match under CACHE_THRESHOLD of the blocks (a shared preamble): load"),
    ([4, 0], [SKEW_ABS + 1, 0], [True, True], 4, 1, "skewed: more than SKEW_ABS above an idle replica"),
    ([4, 0], [SKEW_ABS + 42, 40], [True, True], 4, 0, "not skewed: more than SKEW_ABS above, not SKEW_REL times"),
    ([4, 0], [0, 0], [False, True], 4, 1, "a dead replica takes nothing, whatever it holds"),
])
def test_choose_replica(matches, loads, alive, num_blocks, expected, why):
    assert choose_replica(matches, loads, alive, num_blocks) == expected, why


def test_choose_replica_with_no_live_replica_raises():
    with pytest.raises(ValueError, match="no data-parallel replica"):
        choose_replica([0, 0], [0, 0], [False, False], 1)


def test_router_hashes_are_the_kv_cache_managers():
    tokens = PREFIX + [7, 8, 9]
    request = Request("r", tokens, SamplingParams(), None, 0.0, block_size=16, cache_salt="tenant")
    router = DPRouter(2, block_size=16, capacity_blocks=64)
    assert router.block_hashes(tokens, "tenant") == request.block_hashes and len(request.block_hashes) == 4


def test_a_shared_prefix_follows_its_replica_and_distinct_prompts_spread_by_load():
    router = DPRouter(2, block_size=16, capacity_blocks=64, policy="prefix")
    assert router.route(["a"], PREFIX + [1], None) == 0  # idle replicas: rank 0
    assert router.route(["b"], OTHER + [1], None) == 1  # no match: replica 1 is less loaded
    assert router.route(["c"], OTHER + [2], None) == 1  # OTHER lives on 1
    assert router.route(["d"], PREFIX + [2], None) == 0  # PREFIX lives on 0
    assert router.release("b") == 1 and router.release("c") == 1 and router.release("c") is None
    assert router.route(["e"], PREFIX + [3], "salt") == 1  # another salt matches nothing on 0: the least loaded
    assert router.route(["f"], PREFIX + [3], "salt") == 1  # the salted blocks live on 1 now
    assert router.loads() == [2 * 4, 2 * 4]  # nothing reported running yet: everything counts as waiting
    router.set_running(0, 1)
    assert router.loads() == [1 * 4 + 1, 2 * 4]
    assert router.release("a") == 0 and router.num_unfinished(0) == 1


def test_remembered_hashes_are_bounded_least_recently_sent_first():
    router = DPRouter(2, block_size=16, capacity_blocks=4, policy="prefix")
    router.route(["a"], PREFIX, None)
    router.release("a")
    router.route(["b"], OTHER, None)  # a tie: replica 0, which forgets PREFIX (4 blocks of room)
    router.release("b")
    router.route(["x"], [1] * 16, None)  # a tie: replica 0 takes it, now more loaded
    assert router.route(["c"], PREFIX, None) == 1  # PREFIX is forgotten: the least loaded replica


def test_round_robin_skips_dead_replicas_and_one_replica_needs_no_hashing():
    router = DPRouter(3, block_size=16, capacity_blocks=64, policy="round_robin")
    assert [router.route([str(i)], PREFIX, None) for i in range(4)] == [0, 1, 2, 0]
    router.mark_dead(1)
    assert [router.route([f"x{i}"], PREFIX, None) for i in range(3)] == [2, 0, 2]
    single = DPRouter(1, block_size=16, capacity_blocks=64)
    assert single.route(["0_r", "1_r"], PREFIX, None) == 0 and single.num_unfinished(0) == 2
    assert single.replicas[0].cached == {}
