"""PDConnector: disaggregated prefill/decode with vLLM's NixlConnector protocol (registered as PagedLLMPDConnector
and as NixlConnector, so `--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'` works
unchanged); pagedllm moves the bytes over a plain TCP socket (kv_transfer/pd_wire.py), not NIXL.

The proxy (vllm-router in P/D mode, vLLM's toy proxy) sends the prompt to a producer (kv_producer or kv_both) with
kv_transfer_params {"do_remote_decode": true} and max_tokens 1. When it finishes (length-capped), request_finished
keeps its blocks and answers

    {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [...], "remote_engine_id": ...,
     "remote_request_id": ..., "remote_host": ..., "remote_port": ..., "tp_size": ...}

which the proxy passes to a consumer (kv_consumer or kv_both) with the same prompt. The consumer loads the prompt
past its own prefix-cache hit (get_num_new_matched_tokens: asynchronously, the request waits in
WAITING_FOR_REMOTE_KVS), its workers pull those blocks from the producer's, and the request then computes its last
prompt token alone. The producer frees the blocks once every consumer rank has read them, or after the abort
timeout.

kv_connector_extra_config keys: "abort_request_timeout" (seconds a producer keeps unread blocks; default
VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480), "side_channel_timeout" (seconds a side-channel connection may stall before the
transfer counts as failed; default 30), "allowed_remote_hosts" (a consumer pulls only from these hosts; default: any
host the kv_transfer_params name, which lets a client that reaches the consumer directly make it connect anywhere).
The side channel listens on kv_ip:kv_port (VLLM_NIXL_SIDE_CHANNEL_HOST /
VLLM_NIXL_SIDE_CHANNEL_PORT override them, as vLLM's NixlConnector reads them), + data-parallel rank * tp size +
tensor-parallel rank.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.core.request import RequestStatus
from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedllm.kv_transfer.pd_wire import PD_COUNTERS
from pagedllm.math_utils import cdiv

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.messages import KVConnectorOutput

logger = logging.getLogger(__name__)

REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
DEFAULT_SIDE_CHANNEL_TIMEOUT_S = 30.0


class PDConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_rank: tuple[int, int, int] = (0, 0, 1)):
        super().__init__(config, role, kv_rank)
        ktc = self.kv_transfer_config
        self.engine_id = f"{ktc.engine_id}_dp{self.dp_rank}" if self.dp_rank else str(ktc.engine_id)
        """Each data-parallel replica is its own engine (vLLM's _dp suffix; replica 0 keeps the configured id: each
        replica's engine core sees a data-parallel size of 1)."""
        self.block_size = config.cache_config.block_size
        self.is_producer, self.is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self.host = envs.VLLM_NIXL_SIDE_CHANNEL_HOST or ktc.kv_ip
        base_port = envs.VLLM_NIXL_SIDE_CHANNEL_PORT if envs.is_set("VLLM_NIXL_SIDE_CHANNEL_PORT") else ktc.kv_port
        self.port = base_port + self.dp_rank * self.tp_size
        """This replica's tensor-parallel rank 0's side channel (rank t listens on port + t)."""
        self.abort_timeout_s = float(ktc.get_from_extra_config("abort_request_timeout",
                                                               envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT))
        timeout_s = float(ktc.get_from_extra_config("side_channel_timeout", DEFAULT_SIDE_CHANNEL_TIMEOUT_S))
        hosts = ktc.get_from_extra_config("allowed_remote_hosts", None)
        if hosts is not None and not (isinstance(hosts, list) and all(isinstance(h, str) for h in hosts)):
            raise ValueError("--kv-transfer-config: allowed_remote_hosts must be a list of host names or addresses.")
        self.allowed_remote_hosts = frozenset(hosts) if hosts is not None else None
        """A consumer pulls only from these producers' hosts (None: from any host the client's kv_transfer_params
        name, as vLLM's NixlConnector does: only for proxies that clients cannot bypass)."""
        if self.abort_timeout_s <= 0 or timeout_s <= 0:
            raise ValueError("--kv-transfer-config: abort_request_timeout and side_channel_timeout must be > 0.")
        self.worker = None
        if role == KVConnectorRole.WORKER:
            from pagedllm.kv_transfer.pd_worker import PDWorker

            listen = (self.host, self.port + self.tp_rank) if self.is_producer else None
            self.worker = PDWorker(self.engine_id, self.tp_rank, self.tp_size, listen, timeout_s)
            return
        if ktc.kv_connector == "NixlConnector":
            logger.info("NixlConnector: pagedllm speaks its kv_transfer_params protocol but moves the KV bytes over "
                        "a plain TCP socket (side channel %s:%d), not NIXL.", self.host, self.port)
        self._reqs_need_recv: dict[str, tuple[Request, list[int], int]] = {}
        """Consumer requests to pull -> (request, local blocks to fill, index of the first in the block table)."""
        self._reqs_in_batch: set[str] = set()
        self._reqs_not_processed: set[str] = set()
        self._reqs_need_send: dict[str, tuple[float, list[int]]] = {}
        """Finished producer requests -> (when their blocks are freed unread, time.monotonic(); their blocks)."""
        self._stats: dict[str, float] = defaultdict(float)

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """A consumer request (do_remote_prefill) loads its whole prompt past the local hit, asynchronously."""
        params = request.kv_transfer_params
        if self.is_consumer and params and params.get("do_remote_prefill") and self._remote(params) is not None:
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode") and self.is_producer:
            self._reqs_in_batch.add(request.request_id)
        elif params.get("do_remote_prefill") and self.is_consumer:
            if self._remote(params) is not None:
                num_prompt = len(request.prompt_token_ids)
                first = (num_prompt - num_external_tokens) // self.block_size  # the blocks past the local hit
                local = list(block_ids[first:cdiv(num_prompt, self.block_size)]) if num_external_tokens else []
                self._reqs_need_recv[request.request_id] = (request, local, first)
            else:
                logger.warning("Request %s: kv_transfer_params with do_remote_prefill but without valid %s; its "
                               "prompt is computed here.", request.request_id, ", ".join(REMOTE_FIELDS))
            params["do_remote_prefill"] = False  # one transfer per request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self._reqs_need_recv:
            meta["reqs_to_recv"] = {req_id: _recv_spec(request.kv_transfer_params, local, first)
                                    for req_id, (request, local, first) in self._reqs_need_recv.items()}
        if self._reqs_in_batch:
            meta["reqs_in_batch"] = sorted(self._reqs_in_batch)
        if self._reqs_not_processed:
            meta["reqs_not_processed"] = sorted(self._reqs_not_processed)
        if self._reqs_need_send:
            meta["reqs_to_send"] = self._reqs_need_send
        self._reqs_need_recv, self._reqs_in_batch, self._reqs_not_processed = {}, set(), set()
        self._reqs_need_send = {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill") and self.is_consumer:
            # Ended before it was scheduled: tell the producer (no blocks read) so that it frees its blocks now.
            if self._remote(params) is not None:
                self._reqs_need_recv[request.request_id] = (request, [], 0)
            params["do_remote_prefill"] = False
            return False, None
        if not (params.get("do_remote_decode") and self.is_producer):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            self._reqs_not_processed.add(request.request_id)  # aborted, or stopped by EOS: nothing to pull
            return False, None
        remote_block_ids = list(block_ids[:cdiv(len(request.prompt_token_ids), self.block_size)])
        self._reqs_need_send[request.request_id] = (time.monotonic() + self.abort_timeout_s, remote_block_ids)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": remote_block_ids,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": self.host, "remote_port": self.port, "tp_size": self.tp_size,
        }

    def _remote(self, params: dict[str, Any]) -> dict[str, Any] | None:
        return _remote(params, self.allowed_remote_hosts)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for name, value in (connector_output.kv_connector_stats or {}).items():
            if name in PD_COUNTERS:  # its own only: under MultiConnector every connector sees every counter
                self._stats[name] += value

    def get_stats(self) -> dict[str, float]:
        return dict(self._stats)

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker.get_finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> dict[str, float]:
        return self.worker.take_stats()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _recv_spec(params: dict[str, Any], local: list[int], first: int) -> dict[str, Any]:
    """A pull for the workers: the producer's blocks at the same places in the prompt as `local` (the blocks past
    this instance's prefix-cache hit, from block `first` on); fewer than `local` if the producer's prompt was
    shorter (the pull then fails and its blocks are recomputed)."""
    spec = _remote(params, None)
    return {**spec, "remote_block_ids": spec["remote_block_ids"][first:first + len(local)], "local_block_ids": local}


def _remote(params: dict[str, Any], allowed_hosts: frozenset[str] | None) -> dict[str, Any] | None:
    """What a consumer's workers need to pull a request from a producer (msgpack-able), from the client's
    kv_transfer_params; None when they are not a producer's answer, or name a host outside `allowed_hosts` (None:
    any): the prompt is then computed here."""
    try:
        block_ids, port, tp_size = params["remote_block_ids"], params["remote_port"], params.get("tp_size", 1)
        if not (isinstance(block_ids, list) and all(type(b) is int and b >= 0 for b in block_ids)
                and type(port) is int and 0 < port < 65536 and type(tp_size) is int and tp_size >= 1):
            return None
        names = {k: params[k] for k in ("remote_engine_id", "remote_request_id", "remote_host")}
        if not all(isinstance(v, str) and v for v in names.values()):
            return None
        if allowed_hosts is not None and names["remote_host"] not in allowed_hosts:
            logger.warning("kv_transfer_params name remote_host %r, not one of allowed_remote_hosts; the prompt is "
                           "computed here.", names["remote_host"][:100])
            return None
    except KeyError:
        return None
    return {**names, "remote_block_ids": block_ids, "remote_port": port, "tp_size": tp_size}
