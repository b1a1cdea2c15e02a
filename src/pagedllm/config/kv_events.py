"""KVEventsConfig: vLLM's --kv-events-config (the same JSON keys and defaults), parsed in config/engine.py.

With events enabled, the block pool records what enters and leaves the prefix cache (core/kv_events.py) and the
engine core publishes it once per step (engine/kv_event_publisher.py), so an external router can track each
replica's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.bounds import KV_EVENTS_BOUNDS, check_bounds

KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    """Record KV-cache events: BlockStored, BlockRemoved, AllBlocksCleared (off: nothing recorded, no socket)."""
    publisher: str | None = None
    """zmq (a ZMQ PUB socket) or null (recorded and dropped). Default: zmq when events are enabled, else null."""
    endpoint: str = "tcp://*:5557"
    """The PUB socket's address: bound when it has a wildcard (*, ::) or is ipc:// or inproc://, else connected."""
    replay_endpoint: str | None = None
    """A ROUTER socket (bound) that answers an 8-byte big-endian start sequence number with the buffered batches
    from it on, then an end marker. None: no replay."""
    buffer_steps: int = 10_000
    """Batches (one per engine step that had events) kept for replay."""
    hwm: int = 100_000
    """ZMQ high-water mark of the PUB socket: beyond it a slow subscriber misses messages."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; beyond it a batch is dropped (its sequence number is skipped, so
    subscribers see the gap) rather than blocking the engine's step."""
    topic: str = ""
    """The first frame of every message; subscribers filter on it."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"--kv-events-config publisher must be null or zmq, got {self.publisher!r}.")
        check_bounds(self, KV_EVENTS_BOUNDS, json_flag="--kv-events-config")
