"""DPRouter: which data-parallel replica (engine core) takes a request, decided in the API server.

With `--data-parallel-size N` one API server feeds N engine cores, each with its own KV cache. A request (with
n > 1: every child) goes to one replica, the first of these that applies:

1. **Prefix.** The request's full-block hashes are computed here with the KV cache manager's own chained hash
   (`core/block_hash.py`: parent hash, token ids, `cache_salt` in block 0; the engines' block size), so they are
   the very keys the replica's prefix cache looks up. Each replica remembers the hashes of the requests it was
   sent: at most as many as its pool has blocks, the least recently sent forgotten first, as its pool evicts
   its least recently used blocks. A replica's match is the number of leading blocks of the request it holds.
   The prefix gives a preference when the longest match covers at least `CACHE_THRESHOLD` of the request's
   full blocks and not every live replica matches that much; then the replica with the longest match (ties:
   the least loaded) takes the request, unless the load is skewed against it.
2. **Least loaded**, otherwise (ties: the lowest rank). Load is vLLM's `waiting * 4 + running`, counted from what
   this process sent and received: a replica's unfinished engine requests (sent, or children about to be sent,
   and neither finished, rejected nor aborted) of which as many as its latest scheduler stats reported running
   count as running, the rest as waiting. The counts change the moment a request is routed, so a burst
   between two engine steps spreads instead of piling on the replica that looked idle.

**Skewed** (vllm-router's balance rule, in vLLM's load units): the preferred replica's load exceeds the least
loaded replica's by more than `SKEW_ABS` (four waiting requests) and is more than `SKEW_REL` times it. Then the
least loaded replica takes the request, which also teaches it the prefix.

A dead replica takes nothing. `PAGEDLLM_DP_ROUTER=round_robin` sends requests to the live replicas in turn
instead (for measuring what prefix-aware routing gains); `least_loaded` ignores prefixes.

It lives in engine/ beside AsyncLLM, its only user, because the engine frontend routes (entrypoints/ sit above
engine/ in the import layers), and it is pure Python so its choices can be tested without processes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagedllm import envs
from pagedllm.core.block_hash import BlockHash, append_block_hashes

CACHE_THRESHOLD = 0.3
"""Least share of a request's full blocks the longest match must cover to prefer its replica (vllm-router's
--cache-threshold default): below it, a shared chat-template preamble alone would pull every request to one
replica."""
SKEW_ABS = 16
"""Load units (waiting * 4 + running) by which the preferred replica may exceed the least loaded one."""
SKEW_REL = 1.5
"""And the ratio (vllm-router's --balance-rel-threshold default)."""
POLICIES = ("prefix", "least_loaded", "round_robin")


def choose_replica(matches: Sequence[int], loads: Sequence[int], alive: Sequence[bool], num_blocks: int) -> int:
    """The replica for a request of `num_blocks` full blocks, given each replica's leading matched blocks, its
    load and whether it is alive (the rule of the module docstring). Raises ValueError when none is alive."""
    live = [i for i, ok in enumerate(alive) if ok]
    if not live:
        raise ValueError("no data-parallel replica is alive")
    least = min(live, key=lambda i: (loads[i], i))
    best = max(matches[i] for i in live)
    if best == 0 or best < CACHE_THRESHOLD * num_blocks or all(matches[i] == best for i in live):
        return least
    preferred = min((i for i in live if matches[i] == best), key=lambda i: (loads[i], i))
    if loads[preferred] - loads[least] > SKEW_ABS and loads[preferred] > SKEW_REL * loads[least]:
        return least
    return preferred


class _Replica:
    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.cached: OrderedDict[BlockHash, None] = OrderedDict()
        """Hashes of blocks sent here, least recently sent first."""
        self.unfinished = 0
        self.running = 0
        """num_running_reqs of the replica's latest scheduler stats."""
        self.alive = True

    def match(self, hashes: list[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def remember(self, hashes: list[BlockHash]) -> None:
        cached = self.cached
        for h in hashes:
            if h in cached:
                cached.move_to_end(h)
            else:
                cached[h] = None
        while len(cached) > self.capacity:
            cached.popitem(last=False)

    @property
    def load(self) -> int:
        running = min(self.running, self.unfinished)
        return (self.unfinished - running) * 4 + running


class DPRouter:
    """Routes requests to `num_replicas` replicas whose pools hold `capacity_blocks` blocks of `block_size`
    tokens, and keeps what it needs for that: each replica's remembered hashes, unfinished requests (by engine
    request id), running count and liveness. With one replica it only keeps the counts (no hashing)."""

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, prefix_caching: bool = True,
                 policy: str | None = None):
        policy = policy or envs.PAGEDLLM_DP_ROUTER or "prefix"
        if policy not in POLICIES:
            raise ValueError(f"PAGEDLLM_DP_ROUTER must be one of {', '.join(POLICIES)}, got {policy!r}.")
        self.policy = policy if prefix_caching or policy != "prefix" else "least_loaded"
        self.block_size = block_size
        self.replicas = [_Replica(capacity_blocks) for _ in range(num_replicas)]
        self._replica_of: dict[str, int] = {}
        self._next = 0  # round robin

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def route(self, engine_ids: Sequence[str], prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Choose the replica of one request (all its engine requests) and count them there."""
        replica = 0 if len(self.replicas) == 1 else self._choose(prompt_token_ids, cache_salt)
        state = self.replicas[replica]
        for engine_id in engine_ids:
            self._replica_of[engine_id] = replica
        state.unfinished += len(engine_ids)
        return replica

    def _choose(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        replicas = self.replicas
        alive = [r.alive for r in replicas]
        if self.policy == "round_robin":
            live = [i for i, ok in enumerate(alive) if ok]
            if not live:
                raise ValueError("no data-parallel replica is alive")
            choice = min(live, key=lambda i: (i - self._next) % len(replicas))
            self._next = choice + 1
            return choice
        loads = [r.load for r in replicas]
        if self.policy == "least_loaded":
            return choose_replica([0] * len(replicas), loads, alive, 0)
        hashes = self.block_hashes(prompt_token_ids, cache_salt)
        choice = choose_replica([r.match(hashes) for r in replicas], loads, alive, len(hashes))
        replicas[choice].remember(hashes)
        return choice

    def block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """The prompt's full-block hashes: the keys a replica's prefix cache will look up for it."""
        hashes: list[BlockHash] = []
        append_block_hashes(hashes, prompt_token_ids, self.block_size, cache_salt)
        return hashes

    def replica_of(self, engine_id: str) -> int | None:
        return self._replica_of.get(engine_id)

    def release(self, engine_id: str) -> int | None:
        """An engine request finished, was rejected or aborted: it no longer loads its replica. Returns the
        replica (None if it was not counted)."""
        replica = self._replica_of.pop(engine_id, None)
        if replica is not None:
            self.replicas[replica].unfinished -= 1
        return replica

    def num_unfinished(self, replica: int) -> int:
        return self.replicas[replica].unfinished

    def set_running(self, replica: int, num_running: int) -> None:
        self.replicas[replica].running = num_running

    def loads(self) -> list[int]:
        return [r.load for r in self.replicas]

    def mark_dead(self, replica: int) -> None:
        self.replicas[replica].alive = False
        self.replicas[replica].cached.clear()
