"""The KV-event publisher: sends the engine's KVEventBatches (core/kv_events.py) on ZMQ, as vLLM does.

    engine main thread: publish(batch) ──queue──▶ publisher thread ──PUB──▶ [topic, seq, payload]
                                                                  ◀─ROUTER─ replay requests

`publish` only numbers the batch and queues it: encoding and sending happen on a background thread, so a slow
subscriber never slows the step. Each message on the PUB socket is three frames, vLLM 0.32's layout:
    topic (UTF-8) | sequence number (8 bytes, big-endian, from 0) | msgspec msgpack of the KVEventBatch
A subscriber that sees a sequence gap asks the replay socket (a ROUTER, `replay_endpoint`) for what it missed:
it sends the first missing sequence number as 8 big-endian bytes (from a DEALER socket, after an empty delimiter
frame) and gets one [topic, seq, payload] message per buffered batch from there on (the last `buffer_steps`
batches are kept), then the end marker [b"", -1 as 8 signed big-endian bytes, b""]. (A REQ socket, as vLLM's
example subscriber uses, takes only the first of those messages: ZMQ's REQ accepts one reply per request.)

When the queue holds `max_queue_size` batches the new one is dropped with a warning, never waited for; its
sequence number is used up, so subscribers see the gap (and replay cannot fill it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.core.kv_events import EventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay's end marker."""

_POLL_S = 0.05
"""How long the publisher thread waits for a batch before it looks at the replay socket again."""


class NullEventPublisher:
    """publisher "null": events are recorded and dropped."""

    def publish(self, batch: EventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """A PUB socket for the batches and an optional ROUTER socket that replays the buffered ones.

    The sockets are created (and bound) here, so a bad or busy endpoint fails at startup; after that only the
    publisher thread touches them.

    Args:
        config: the endpoints, buffer sizes and topic.
        data_parallel_rank: stamped on every batch; rank r publishes on the endpoint's port + r (vLLM's layout).

    Raises:
        ValueError: an endpoint cannot be bound or connected (in use, malformed).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, EventBatch]] = queue.Queue(maxsize=config.max_queue_size)
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._num_dropped = 0
        self._closing = threading.Event()
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(config.hwm)
            _bind_or_connect(self._pub, self.endpoint, "endpoint")
            self._replay = None
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _bind(self._replay, self.replay_endpoint, "replay_endpoint")
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s, topic %r", self.endpoint,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", config.topic)

    def publish(self, batch: EventBatch) -> None:
        """Number the batch and queue it; never blocks (a full queue drops it, leaving a sequence gap)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self._num_dropped += 1
            if self._num_dropped == 1 or self._num_dropped % 1000 == 0:
                logger.warning("KV events: the publisher queue is full; dropped %d batches so far (sequence "
                               "numbers skipped)", self._num_dropped)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to timeout_s), then close the sockets."""
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop in %.1f s", timeout_s)
        self._ctx.destroy(linger=0)

    # ---- publisher thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._send_until_closed()
        except zmq.ContextTerminated:
            return  # shutdown() gave up waiting and destroyed the context
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _send_until_closed(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                seq, batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            try:
                payload = encode(batch)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
                self._replay_buffer.append((seq, payload))
            except zmq.ContextTerminated:
                raise
            except Exception:
                logger.exception("KV events: could not publish batch %d", seq)
                time.sleep(0.1)  # no tight error loop

    def _serve_replays(self) -> None:
        """Answer every waiting replay request: the buffered batches from its start sequence on, then END_SEQ."""
        replay = self._replay
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
                continue
            identity, delimiter, start_bytes = frames
            start_seq = int.from_bytes(start_bytes, "big")
            for seq, payload in self._replay_buffer:
                if seq >= start_seq:
                    replay.send_multipart((identity, delimiter, self._topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((identity, delimiter, b"", END_SEQ, b""))


def create_kv_event_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0):
    """The publisher the config asks for; None when events are off (nothing recorded, no socket)."""
    if config is None or not config.enable_kv_cache_events:
        return None
    if config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank r: tcp port + r (port 0 stays 0), ipc/inproc path + "_dp{r}".

    >>> offset_endpoint_port("tcp://*:5557", 2)
    'tcp://*:5559'
    """
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{host}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard address (*, ::) or an ipc/inproc path; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind_or_connect(sock: zmq.Socket, endpoint: str, key: str) -> None:
    if _binds(endpoint):
        _bind(sock, endpoint, key)
        return
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"--kv-events-config {key} {endpoint!r}: cannot connect: {e}") from None


def _bind(sock: zmq.Socket, endpoint: str, key: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"--kv-events-config {key} {endpoint!r}: cannot bind: {e}") from None
