"""PDWorker: the worker side of the P/D connector (kv_transfer/pd_connector.py), one per tensor-parallel rank.

As a producer it serves its blocks on the side channel (a listening TCP socket and a thread per connection,
kv_transfer/pd_wire.py has the format): a consumer reads blocks of a request the scheduler named (reqs_in_batch: the
request ran here; reqs_to_send: it finished, its blocks are kept, and these are its blocks: a read that names any
other block is refused, so a consumer never sees another request's KV), says it is done, and once every consumer
rank that reads this rank has done so the request is reported in finished_sending (the scheduler then frees its
blocks). A request nobody reads within the abort timeout is reported too (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).

As a consumer it pulls the blocks a request needs on a background thread, writing them straight into the blocks the
scheduler allocated (no other request uses them meanwhile), and reports the request in finished_recving once the
pull ended; a failed pull also reports the request's blocks in get_block_ids_with_load_errors, in the same step
(kv_load_failure_policy then recomputes them or fails the request).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pagedllm.kv_transfer.pd_wire import (
    PD_COUNTERS,
    WIRE_VERSION,
    WireError,
    consumers_per_producer,
    producer_reads,
    rank_heads,
    recv_exact,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)

SENT_BYTES, RECEIVED_BYTES, FAILED_TRANSFERS, EXPIRED_SENDS = PD_COUNTERS
"""The counters the workers report (summed over the ranks; /metrics adds _total)."""


class PDWorker:
    def __init__(self, engine_id: str, tp_rank: int, tp_size: int, listen: tuple[str, int] | None,
                 timeout_s: float):
        """listen: (host, port) of this rank's side channel (a producer), or None (a consumer alone).
        timeout_s: how long a side-channel connection may stall before it counts as failed."""
        self.engine_id = engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timeout_s = timeout_s
        self.kv_caches: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._sendable = threading.Condition(self._lock)
        """Notified when the scheduler's plan names requests to send (a read may arrive just before it)."""
        self._stop = threading.Event()
        self._stats: dict[str, float] = defaultdict(float)
        # producer state (under _lock)
        self._to_process: set[str] = set()
        """Requests that ran here as producer requests: readable while they are in this set."""
        self._to_send: dict[str, tuple[float, frozenset[int]]] = {}
        """Finished producer requests whose blocks are kept -> (when they expire (time.monotonic()), their blocks:
        a read names no other block)."""
        self._reads: dict[str, int] = defaultdict(int)
        """Consumer ranks done reading a request (it is sent once consumers_per_producer have)."""
        self._active: dict[str, int] = defaultdict(int)
        """Reads in progress per request: never expired meanwhile."""
        self._sent: set[str] = set()
        # consumer state (under _lock)
        self._recv_done: dict[str, list[int]] = {}
        """Pulls that ended -> the local blocks they failed to fill ([]: all loaded)."""
        self._invalid: set[int] = set()
        self._pulls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pd-pull")
        self._listen = listen
        self._listener: socket.socket | None = None

    # ---- set-up ------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = [kv_caches[name] for name in sorted(kv_caches, key=lambda n: int(n.rsplit(".", 1)[1]))]
        if self._listen is not None and self._listener is None:
            host, port = self._listen
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((host, port))
            except OSError as e:
                listener.close()
                raise RuntimeError(f"the KV side channel cannot listen on {host}:{port} ({e}); give each "
                                   "instance its own kv_port in --kv-transfer-config.") from None
            listener.listen(64)
            listener.settimeout(0.5)
            self._listener = listener
            threading.Thread(target=self._accept_loop, name="pd-side-channel", daemon=True).start()
            logger.info("KV side channel of tensor-parallel rank %d listening on %s:%d", self.tp_rank, host, port)

    def shutdown(self) -> None:
        self._stop.set()
        self._pulls.shutdown(wait=False, cancel_futures=True)
        if self._listener is not None:
            self._listener.close()

    # ---- per step ----------------------------------------------------------------------------------
    def start_load_kv(self, meta: dict[str, Any]) -> None:
        with self._lock:
            self._to_process.update(meta.get("reqs_in_batch", ()))
            for req_id in meta.get("reqs_not_processed", ()):
                self._to_process.discard(req_id)
            for req_id, (expires, block_ids) in meta.get("reqs_to_send", {}).items():
                if req_id in self._to_process:
                    self._to_send[req_id] = (expires, frozenset(block_ids))
            self._sendable.notify_all()
        for req_id, spec in meta.get("reqs_to_recv", {}).items():
            self._pulls.submit(self._pull, req_id, spec)

    def get_finished(self) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            sending, self._sent = self._sent, set()
            for req_id, (expires, _) in list(self._to_send.items()):
                if now >= expires and not self._active[req_id]:
                    logger.warning("Releasing the KV blocks of request %s: no consumer read them in time.", req_id)
                    self._forget(req_id)
                    sending.add(req_id)
                    self._stats[EXPIRED_SENDS] += 1
            recving = set(self._recv_done)
            for failed in self._recv_done.values():
                self._invalid.update(failed)
            self._recv_done = {}
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def take_stats(self) -> dict[str, float]:
        """The counters since the last call."""
        with self._lock:
            stats, self._stats = dict(self._stats), defaultdict(float)
        return stats

    def _forget(self, req_id: str) -> None:
        self._to_process.discard(req_id)
        self._to_send.pop(req_id, None)
        self._reads.pop(req_id, None)
        self._active.pop(req_id, None)

    # ---- producer: the side channel ----------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by shutdown
            threading.Thread(target=self._serve, args=(conn,), name="pd-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        req_id = None
        try:
            conn.settimeout(self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            message = recv_frame(conn)
            req_id, error = self._check_read(message)
            if error is not None:
                send_frame(conn, {"ok": False, "error": error})
                req_id = None
                return
            nbytes = self._send_blocks(conn, message)
            done = recv_frame(conn)
            if done.get("op") != "done":
                raise WireError(f"expected done, got {done.get('op')!r}.")
            with self._lock:
                self._stats[SENT_BYTES] += nbytes
                self._reads[req_id] += 1
                if self._reads[req_id] >= consumers_per_producer(int(message.get("consumer_tp_size", 1)),
                                                                 self.tp_size) and req_id in self._to_send:
                    self._forget(req_id)
                    self._sent.add(req_id)
        except Exception as e:  # a bad or broken read must not take the side channel down
            logger.warning("KV side channel: a read of request %s failed: %s", req_id, e)
            with self._lock:
                self._stats[FAILED_TRANSFERS] += 1
        finally:
            if req_id is not None:
                with self._lock:
                    if req_id in self._active:
                        self._active[req_id] -= 1
            conn.close()

    def _check_read(self, message: dict[str, Any]) -> tuple[str | None, str | None]:
        """(the request id, None) with the read counted active, or (None, why it is refused)."""
        if message.get("op") != "read" or message.get("version") != WIRE_VERSION:
            return None, f"unsupported side-channel message (version {message.get('version')!r})."
        if message.get("engine_id") != self.engine_id:
            return None, f"this is engine {self.engine_id}, not {message.get('engine_id')!r}."
        req_id = message.get("request_id")
        with self._sendable:  # the response can outrun the plan that names its blocks: wait for it a while
            self._sendable.wait_for(lambda: req_id in self._to_send or req_id not in self._to_process,
                                    timeout=self.timeout_s)
            if req_id not in self._to_send:
                return None, f"request {req_id!r} has no KV blocks here (finished, expired or never run)."
            if not {b for b in message.get("block_ids") or () if isinstance(b, int)} <= self._to_send[req_id][1]:
                return None, f"the read names blocks that are not request {req_id!r}'s."
            self._active[req_id] += 1
        return req_id, None

    def _send_blocks(self, conn: socket.socket, message: dict[str, Any]) -> int:
        block_ids = list(message.get("block_ids") or ())
        kv0 = self.kv_caches[0]
        _, num_blocks, block_size, local_heads, head_dim = kv0.shape
        if any(type(b) is not int or not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range [0, {num_blocks}).")
        first, end = rank_heads(self.tp_rank, self.tp_size, local_heads)
        heads = message.get("heads")
        lo, hi = (0, local_heads) if heads is None else (int(heads[0]) - first, int(heads[1]) - first)
        if not 0 <= lo < hi <= local_heads or (heads is not None and int(heads[1]) > end):
            raise ValueError(f"heads {heads} are not on this rank (its heads: [{first}, {end})).")
        shape = [len(self.kv_caches), 2, len(block_ids), block_size, hi - lo, head_dim]
        layer_bytes = 2 * len(block_ids) * block_size * (hi - lo) * head_dim * kv0.element_size()
        nbytes = layer_bytes * len(self.kv_caches)
        send_frame(conn, {"ok": True, "nbytes": nbytes, "shape": shape, "dtype": str(kv0.dtype).removeprefix("torch.")})
        if block_ids:
            index = torch.tensor(block_ids, dtype=torch.long)
            for kv in self.kv_caches:
                part = kv.index_select(1, index)[:, :, :, lo:hi].contiguous()
                conn.sendall(memoryview(part.view(torch.uint8).numpy()).cast("B"))
        return nbytes

    # ---- consumer: pulls ---------------------------------------------------------------------------
    def _pull(self, req_id: str, spec: dict[str, Any]) -> None:
        local = list(spec["local_block_ids"])
        failed: list[int] = []
        try:
            self._pull_blocks(spec, local)
        except Exception as e:  # any failure is a failed load of these blocks
            logger.warning("KV pull of request %s from %s:%s failed: %s", req_id, spec.get("remote_host"),
                           spec.get("remote_port"), e)
            failed = local
            with self._lock:
                self._stats[FAILED_TRANSFERS] += 1
        with self._lock:
            self._recv_done[req_id] = failed

    def _pull_blocks(self, spec: dict[str, Any], local: list[int]) -> None:
        remote = list(spec["remote_block_ids"])  # the same places in the prompt (past the local hit)
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} blocks to load but the producer has {len(remote)} of them.")
        kv0 = self.kv_caches[0] if self.kv_caches else None
        local_heads = kv0.shape[3] if kv0 is not None else 1
        for producer_rank, heads in producer_reads(self.tp_rank, self.tp_size, local_heads, int(spec["tp_size"])):
            self._read_one(spec, producer_rank, heads, local, remote)

    def _read_one(self, spec: dict[str, Any], producer_rank: int, heads: tuple[int, int] | None,
                  local: list[int], remote: list[int]) -> None:
        address = (spec["remote_host"], int(spec["remote_port"]) + producer_rank)
        with socket.create_connection(address, timeout=self.timeout_s) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(conn, {"op": "read", "version": WIRE_VERSION, "engine_id": spec["remote_engine_id"],
                              "request_id": spec["remote_request_id"], "block_ids": remote,
                              "heads": list(heads) if heads is not None else None,
                              "consumer_tp_size": self.tp_size})
            header = recv_frame(conn)
            if not header.get("ok"):
                raise WireError(f"the producer refused the read: {header.get('error')}")
            nbytes = self._receive_blocks(conn, header, heads, local)
            send_frame(conn, {"op": "done"})
        with self._lock:
            self._stats[RECEIVED_BYTES] += nbytes

    def _receive_blocks(self, conn: socket.socket, header: dict[str, Any], heads: tuple[int, int] | None,
                        local: list[int]) -> int:
        if not local:
            return 0
        kv0 = self.kv_caches[0]
        _, _, block_size, local_heads, head_dim = kv0.shape
        first, _ = rank_heads(self.tp_rank, self.tp_size, local_heads)
        lo, hi = (0, local_heads) if heads is None else (heads[0] - first, heads[1] - first)
        expected = [len(self.kv_caches), 2, len(local), block_size, hi - lo, head_dim]
        dtype = str(kv0.dtype).removeprefix("torch.")
        if list(header.get("shape", ())) != expected or header.get("dtype") != dtype:
            raise WireError(f"the producer sends {header.get('shape')} {header.get('dtype')}, this rank needs "
                            f"{expected} {dtype} (the same model, dtype and block size on both sides).")
        index = torch.tensor(local, dtype=torch.long)
        buffer = torch.empty(expected[1:], dtype=kv0.dtype)
        view = memoryview(buffer.view(torch.uint8).numpy()).cast("B")
        for kv in self.kv_caches:
            recv_exact(conn, view)
            if heads is None:
                kv.index_copy_(1, index, buffer)
            else:
                kv[:, index, :, lo:hi] = buffer
        return int(header["nbytes"])
