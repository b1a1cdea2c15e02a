"""KV-cache events from a real EngineCore (the tiny model) to a ZMQ subscriber written the way vLLM's
examples/online_serving/kv_events_subscriber.py is: SUB socket, [topic, 8-byte sequence, msgpack] frames decoded
with msgspec into vLLM 0.32's event types, a replay request when a sequence number is missing. Off (the
default), the engine records nothing and opens no socket."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import pytest
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.block_hash import NONE_HASH, hash_block_tokens
from pagedllm.engine.core import EngineCore
from pagedllm.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16


# ---- the subscriber's side: vLLM 0.32's wire types, declared as a consumer declares them ----------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """Live batches from the PUB socket; missing sequence numbers are fetched from the replay socket."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, topic: str):
        self.topic = topic.encode()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.payloads: dict[int, bytes] = {}
        self.batches: dict[int, KVEventBatch] = {}
        self.num_replayed = 0

    def receive(self, until_seq: int, drop: frozenset[int] = frozenset(), timeout_s: float = 20.0) -> None:
        """Until batch `until_seq` is in. Live batches in `drop` are thrown away (a lost message); a gap, or
        silence while batches are missing (a subscription that started late), is filled by a replay."""
        deadline = time.monotonic() + timeout_s
        while until_seq not in self.batches:
            assert time.monotonic() < deadline, f"no batch {until_seq}; have {sorted(self.batches)}"
            next_seq = max(self.batches, default=-1) + 1
            if not self.sub.poll(500):
                self._add_replayed(next_seq, until_seq + 1)
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq in drop:
                continue
            if seq > next_seq:
                self._add_replayed(next_seq, seq)
            self._add(seq, payload)

    def _add(self, seq: int, payload: bytes) -> None:
        self.payloads[seq] = payload
        self.batches[seq] = self.decoder.decode(payload)

    def _add_replayed(self, start_seq: int, end_seq: int) -> None:
        for seq, payload in self.request_replay(start_seq):
            if seq < end_seq:
                self._add(seq, payload)
                self.num_replayed += 1

    def request_replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """(seq, payload) of every buffered batch from start_seq on, as the replay socket sends them."""
        self.replay.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replay.poll(5000), "no answer from the replay socket"
            empty, topic, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            if not payload:
                assert topic == b"" and int.from_bytes(seq_bytes, "big", signed=True) == -1
                return out
            assert topic == self.topic
            out.append((int.from_bytes(seq_bytes, "big"), payload))


# ---- the engine's side -----------------------------------------------------------------------------------

def _config(model, **kwargs) -> EngineConfig:
    # 8 blocks of 16 tokens: one 128-token request takes the whole pool
    return EngineConfig.from_kwargs(model=str(model), dtype="float32", num_gpu_blocks_override=8, max_model_len=128,
                                    **kwargs)


def _run(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None):
    """Run one request to the end; returns its whole token sequence (prompt + outputs)."""
    core.add_request(EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt, cache_salt=cache_salt, eos_token_id=None,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=time.time()))
    tokens = list(prompt)
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
    return tokens


def _chain(tokens: list[int], num_blocks: int, cache_salt: str | None = None) -> list[int]:
    """The published hashes of the first num_blocks blocks (SHA-256 chain, salt in block 0, low 64 bits)."""
    out, parent = [], NONE_HASH
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], cache_salt if i == 0 else None)
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def _num_sockets() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_engine_publishes_its_prefix_cache_events(tiny_llama_dir, tmp_path):
    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    sockets_before = _num_sockets()
    ctx = zmq.Context()
    subscriber = Subscriber(ctx, endpoint, replay_endpoint, "kv")  # connects before the engine binds
    core = EngineCore(_config(tiny_llama_dir, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay_endpoint, "topic": "kv",
        "buffer_steps": 3}))
    try:
        assert _num_sockets() > sockets_before  # the PUB and ROUTER sockets (and the subscriber's)
        p1 = list(range(3, 43))  # 2 full blocks + 8 tokens, salted
        _run(core, "r1", p1, max_tokens=1, cache_salt="tenant")  # batch 0: 2 blocks stored
        subscriber.receive(until_seq=0)
        p2 = list(range(100, 120))
        t2 = _run(core, "r2", p2, max_tokens=14)  # batch 1: block 0 (prefill); batch 2: block 1 (filled by decodes)
        subscriber.receive(until_seq=2, drop=frozenset({1}))  # batch 1 "lost": filled from the replay socket
        assert subscriber.num_replayed >= 1
        p3 = list(range(200, 320))  # 7 full blocks + 8: needs the whole pool, evicts the 4 cached blocks
        _run(core, "r3", p3, max_tokens=1)  # batch 3
        assert core.reset_prefix_cache()  # batch 4
        subscriber.receive(until_seq=4)
        assert sorted(subscriber.batches) == [0, 1, 2, 3, 4]

        b = subscriber.batches
        h1, h2, h3 = _chain(p1, 2, "tenant"), _chain(t2, 2), _chain(p3, 7)
        assert h1 != _chain(p1, 2)  # the salt is in the published hashes
        (e,) = b[0].events
        assert isinstance(e, BlockStored) and (e.block_hashes, e.parent_block_hash) == (h1, None)
        assert (e.token_ids, e.block_size, e.medium, e.extra_keys) == (p1[:32], 16, "GPU", [("tenant",), None])
        (e,) = b[1].events
        assert (e.block_hashes, e.parent_block_hash, e.token_ids, e.extra_keys) == (h2[:1], None, p2[:16], None)
        (e,) = b[2].events
        assert (e.block_hashes, e.parent_block_hash, e.token_ids) == (h2[1:], h2[0], t2[16:32])
        *removals, e = b[3].events
        assert all(isinstance(r, BlockRemoved) and len(r.block_hashes) == 1 for r in removals)
        assert sorted(r.block_hashes[0] for r in removals) == sorted(h1 + h2)
        assert isinstance(e, BlockStored) and (e.block_hashes, e.token_ids) == (h3, p3[:112])
        assert [type(e) for e in b[4].events] == [AllBlocksCleared]
        assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for batch in b.values())
        # the raw layout: the batch an array [ts, events, data_parallel_rank], each event a map tagged "type"
        raw = msgspec.msgpack.decode(subscriber.payloads[0])
        assert len(raw) == 3 and raw[1][0]["type"] == "BlockStored" and raw[2] == 0

        # the replay buffer keeps the last buffer_steps batches; a start past the end gets only the end marker
        assert [seq for seq, _ in subscriber.request_replay(0)] == [2, 3, 4]
        assert subscriber.request_replay(5) == []
    finally:
        core.shutdown()
        ctx.destroy(linger=0)


def test_off_by_default_records_nothing_and_opens_no_socket(tiny_llama_dir):
    sockets_before = _num_sockets()
    core = EngineCore(_config(tiny_llama_dir))
    try:
        assert core.kv_event_publisher is None
        assert core.scheduler.kv_cache_manager.block_pool.kv_events is None
        assert _num_sockets() == sockets_before
        _run(core, "a", list(range(3, 43)), max_tokens=1)
        assert core.reset_prefix_cache()
        assert core.scheduler.kv_cache_manager.take_events() == []
    finally:
        core.shutdown()


@pytest.mark.parametrize("value, message", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be null or zmq"),
    ('{"enable_kv_cache_events": true, "port": 5557}', "unknown --kv-events-config keys: port"),
])
def test_bad_config_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(kv_events_config=value)


def test_a_data_parallel_replica_publishes_on_its_own_endpoint_with_its_rank(tiny_llama_dir, tmp_path):
    """--data-parallel-size N starts engine cores with ranks 0..N-1 (core_proc --engine-index): rank r publishes
    on the endpoint + r (here an ipc path + "_dp1"), so the replicas do not fight over one socket, and stamps its
    rank on every batch, as vLLM's replicas do."""
    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    ctx = zmq.Context()
    subscriber = Subscriber(ctx, endpoint + "_dp1", replay_endpoint + "_dp1", "kv")
    config = _config(tiny_llama_dir, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay_endpoint, "topic": "kv"})
    core = EngineCore(config, data_parallel_rank=1)
    try:
        _run(core, "r1", list(range(3, 43)), max_tokens=1)
        subscriber.receive(until_seq=0)
        assert subscriber.batches[0].data_parallel_rank == 1
        assert isinstance(subscriber.batches[0].events[0], BlockStored)
    finally:
        core.shutdown()
        ctx.destroy(linger=0)
