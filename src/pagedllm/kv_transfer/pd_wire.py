"""The P/D side channel's wire format and the KV heads each rank moves (kv_transfer/pd_connector.py).

pagedllm moves the blocks over a plain TCP socket, not NIXL. A consumer rank opens one connection per producer
rank it reads from (the producer rank t of data-parallel rank d listens on port + d * tp_size + t, the port it
advertised being rank 0's) and sends one frame:

    {"op": "read", "version": 1, "engine_id": <the producer's engine id>, "request_id": <the producer's request id>,
     "block_ids": [<producer block ids>], "heads": [first, end) global KV heads or null (all of that rank's),
     "consumer_tp_size": n}

The producer answers one frame {"ok": true, "nbytes": N, "shape": [layers, 2, blocks, block_size, heads, head_dim],
"dtype": "bfloat16"} followed by N bytes (layer by layer: that layer's K then V of the blocks, in order), or
{"ok": false, "error": "..."}. The consumer writes them into its own blocks and answers {"op": "done"}: the
producer counts the request read (its blocks are freed once every consumer rank that reads it has said so). An
empty block_ids list is a notification alone (a consumer that had every block in its prefix cache, or whose request
ended before it was scheduled). A frame is a 4-byte big-endian length and a msgpack map.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

WIRE_VERSION = 1
PD_COUNTERS = ("pagedllm:kv_transfer_sent_bytes", "pagedllm:kv_transfer_received_bytes",
               "vllm:nixl_num_failed_transfers", "pagedllm:kv_transfer_expired_sends")
"""The counters the workers report (bytes served, bytes pulled, failed transfers, sends freed unread after the abort
timeout), summed over the ranks; /metrics shows them with _total."""
MAX_FRAME_BYTES = 1 << 24
_LENGTH = struct.Struct(">I")


class WireError(Exception):
    """The peer broke the protocol, refused the read, or the connection failed."""


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (WireError when the peer closes first)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise WireError("the peer closed the connection mid-transfer.")
        got += n


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    header = bytearray(_LENGTH.size)
    recv_exact(sock, memoryview(header))
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {length} bytes is larger than {MAX_FRAME_BYTES}.")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    message = msgspec.msgpack.decode(bytes(body))
    if not isinstance(message, dict):
        raise WireError("a frame is not a map.")
    return message


def rank_heads(rank: int, tp_size: int, local_heads: int) -> tuple[int, int]:
    """A rank's [first, end) global KV heads when the heads are split across the ranks (not replicated)."""
    return rank * local_heads, (rank + 1) * local_heads


def producer_reads(consumer_rank: int, consumer_tp: int, consumer_heads: int,
                   producer_tp: int) -> list[tuple[int, tuple[int, int] | None]]:
    """The producer ranks a consumer rank reads and, for each, the global heads it reads (None: all of that rank's,
    the same tensor-parallel size on both sides, rank to rank). Different sizes need the heads split on both sides:
    total heads = consumer_heads * consumer_tp, divisible by producer_tp (else ValueError)."""
    if producer_tp == consumer_tp:
        return [(consumer_rank, None)]
    total = consumer_heads * consumer_tp
    if producer_tp < 1 or total % producer_tp:
        raise ValueError(f"cannot read {total} KV heads from a producer of tensor-parallel size {producer_tp}.")
    per_producer = total // producer_tp
    first, end = rank_heads(consumer_rank, consumer_tp, consumer_heads)
    reads = []
    for rank in range(first // per_producer, (end - 1) // per_producer + 1):
        p_first, p_end = rank_heads(rank, producer_tp, per_producer)
        reads.append((rank, (max(first, p_first), min(end, p_end))))
    return reads


def consumers_per_producer(consumer_tp: int, producer_tp: int) -> int:
    """How many consumer ranks read one producer rank (each reads its share of the heads)."""
    return max(1, consumer_tp // producer_tp)
