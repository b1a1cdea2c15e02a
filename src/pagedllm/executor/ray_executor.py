"""RayExecutor: one Ray actor per rank on a Ray cluster (`--distributed-executor-backend ray`).

    engine process (the Ray driver) ── ray.init(address) ──▶ placement group: one {"CPU": 1} bundle per rank, PACK
        │                                                     one actor per bundle (RayWorker)
        ├─ XPUB tcp://<this node>:*  ──▶ every actor: the mp worker's loop (executor/worker_proc.py) around the
        └─ PULL tcp://<this node>:*  ◀──               same Worker, steps as msgspec msgpack (zmq_executor.py)
       ranks ◀── torch.distributed (gloo) rendezvous at tcp://<rank 0's node>:<a port free there> ──▶ ranks

Ray does placement, lifecycle and health only: the steps go over ZMQ and the tensors over torch.distributed as
with mp, so a rank runs exactly the code an mp worker runs. Ray calls carry only strings, ints and the
configuration as msgspec JSON (Ray itself ships the actor class with cloudpickle: a Ray cluster runs whatever
code its drivers send, so it must be one trusted network, and so must the workers' TCP sockets).

Placement: PACK (vLLM's strategy) fills a node before the next, so the ranks of a tensor-parallel group stay on
one node when they fit; ranks are numbered node by node, the engine's own node first, so consecutive ranks (a
tensor-parallel group; pipeline stages come after) share a node. Each rank reserves 1 CPU and runs
`node CPUs // ranks on that node` threads, its share of the node as with mp.

Health: a worker that exits is seen twice, whichever comes first: its TCP connection to the engine closes (a
ZMQ socket monitor), and Ray fails the actor's `run` call; during a step, the other ranks' torch.distributed calls
to it fail as well and fail the step (a killed node: streams end within 0.3 s, tests/reliability/
test_ray_cluster.py). A node that hangs or is cut off closes nothing: ZMQ
heartbeats on the connection close it after HEARTBEAT_TIMEOUT_MS. Each takes the engine-death path.

Shutdown sends Shutdown, then kills the actors and removes the placement group; the actors die with the engine
process however it dies (Ray ends a driver's actors).
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
import zmq
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from zmq.utils.monitor import recv_monitor_message

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.executor.zmq_executor import POLL_MS, ZmqExecutor, free_port, log_level_name
from pagedllm.models.loader import resolve_device

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGY = "PACK"
PLACEMENT_TIMEOUT_S = 120.0
"""How long the cluster may take to find a bundle for every rank (nodes still joining) before start-up fails."""
RAY_CALL_TIMEOUT_S = 300.0
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 6000
"""A worker connection silent this long (its node hung, or cut off without closing it) counts as a dead worker:
ZMQ's heartbeats are answered by the worker's ZMQ thread, busy steps or not, so only a frozen process or a lost
network misses them (measured: a frozen node stops the engine 6-7 s after; Ray alone had not noticed after 10)."""
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class RayWorker:
    """One rank in a Ray actor: where it runs, a port free there, then the mp worker's loop until Shutdown."""

    def node(self) -> tuple[str, str]:
        """(this node's Ray id, its IP address)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port(ray.util.get_node_ip_address())

    def run(self, config_json: bytes, rank: int, broadcast_addr: str, result_addr: str, init_method: str,
            threads: int, log_level: str) -> int:
        """executor/worker_proc.py's run_worker with `threads` threads; returns when the engine says Shutdown."""
        import torch

        from pagedllm.executor.worker_proc import run_worker

        logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s [worker {rank}] %(message)s",
                            datefmt="%m-%d %H:%M:%S")
        torch.set_num_threads(threads)
        config = msgspec.json.decode(config_json, type=EngineConfig)
        return run_worker(config, rank, broadcast_addr, result_addr, init_method)


@dataclass
class _RayWorkers:
    """What RayExecutor's finalizer stops (never the executor itself)."""

    actors: list = field(default_factory=list)
    """In rank order once placed."""
    run_refs: list = field(default_factory=list)
    """Each rank's RayWorker.run call: resolves when its loop ends or its actor dies."""
    placement_group: Any = None
    owns_ray: bool = False
    """This executor called ray.init, so it calls ray.shutdown."""
    stop: threading.Event = field(default_factory=threading.Event)
    watcher: threading.Thread | None = None


class RayExecutor(ZmqExecutor):
    def _make_worker_resources(self) -> tuple:
        self.workers = _RayWorkers()
        self.nodes: list[tuple[str, str]] = []
        """Each rank's (Ray node id, IP address)."""
        return self.ctx, self.workers

    # ---- placement -------------------------------------------------------------------------------
    def _place_workers(self) -> None:
        pc = self.config.parallel_config
        if resolve_device(self.config.model_config.device).type != "cpu":
            raise ValueError("--distributed-executor-backend ray places CPU workers only (one CPU bundle per "
                             "rank); use mp on a GPU machine.")
        if not ray.is_initialized():
            self._join_ray_cluster(pc.ray_address)
        n = self.world_size
        pg = placement_group([{"CPU": 1.0}] * n, strategy=PLACEMENT_STRATEGY)
        self.workers.placement_group = pg
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"the Ray cluster could not place {n} workers of 1 CPU each within "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s (placement group strategy {PLACEMENT_STRATEGY}); it "
                               f"has {ray.available_resources().get('CPU', 0):g} of "
                               f"{ray.cluster_resources().get('CPU', 0):g} CPUs free (`ray status` shows its "
                               "nodes).")
        options: dict[str, Any] = {"num_cpus": 1, "max_restarts": 0}
        env_vars = envs.with_prefix("PAGEDLLM_")
        if env_vars:  # this process's pagedllm settings (kernels, cache dir) hold on every node
            options["runtime_env"] = {"env_vars": env_vars}
        actor_class = ray.remote(RayWorker)
        actors = [actor_class.options(
            **options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
        ).remote() for i in range(n)]
        self.workers.actors.extend(actors)  # stopped on failure from here on
        nodes = ray.get([actor.node.remote() for actor in actors], timeout=RAY_CALL_TIMEOUT_S)
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(n), key=lambda i: (nodes[i][0] != here, nodes[i][1], nodes[i][0], i))
        self.workers.actors[:] = [actors[i] for i in order]
        self.nodes = [nodes[i] for i in order]

    def _join_ray_cluster(self, address: str | None) -> None:
        """ray.init(address): None means RAY_ADDRESS, else the cluster `ray start` started on this machine, else a
        new local one (ray.init's rules, as vLLM). Ray installs a SIGTERM handler in a driver; the engine's own
        (engine/core_proc.py) is put back."""
        where = address or envs.RAY_ADDRESS or "this machine (or a new local one)"
        logger.info("joining the Ray cluster at %s", where)
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(address=address)
        except Exception as e:
            raise RuntimeError(f"could not join the Ray cluster at {where}: {type(e).__name__}: {e}") from e
        finally:
            if sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, sigterm)
        self.workers.owns_ray = True

    def _threads(self) -> list[int]:
        """Each rank's share of its node's CPUs (as Ray counts them)."""
        cpus = {node["NodeID"]: int(node.get("Resources", {}).get("CPU", 1)) for node in ray.nodes()
                if node.get("Alive")}
        ranks_on = collections.Counter(node_id for node_id, _ in self.nodes)
        return [max(1, cpus.get(node_id, 1) // ranks_on[node_id]) for node_id, _ in self.nodes]

    # ---- sockets and start -----------------------------------------------------------------------
    def _bind(self, sock: zmq.Socket, name: str) -> str:
        ip = ray.util.get_node_ip_address()
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if ":" in ip:
            sock.setsockopt(zmq.IPV6, 1)
        if name == "results":  # every worker connects here: its disconnection is its death
            self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        sock.bind(f"tcp://{_host(ip)}:*")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _start_workers(self, broadcast_addr: str, result_addr: str) -> None:
        actors = self.workers.actors
        port = ray.get(actors[0].free_port.remote(), timeout=RAY_CALL_TIMEOUT_S)
        init_method = f"tcp://{_host(self.nodes[0][1])}:{port}"
        config_json = msgspec.json.encode(self.config)
        threads = self._threads()
        level = log_level_name()
        for rank, actor in enumerate(actors):
            self.workers.run_refs.append(actor.run.remote(config_json, rank, broadcast_addr, result_addr,
                                                          init_method, threads[rank], level))
        logger.info("started %d Ray workers on %d nodes (placement group %s; torch.distributed at %s): %s",
                    self.world_size, len({node_id for node_id, _ in self.nodes}), PLACEMENT_STRATEGY, init_method,
                    ", ".join(f"rank {r} on {ip} ({threads[r]} threads)" for r, (_, ip) in enumerate(self.nodes)))

    # ---- health ----------------------------------------------------------------------------------
    def _watch_workers(self) -> None:
        self.workers.watcher = threading.Thread(target=self._watch, name="ray-workers-watch", daemon=True)
        self.workers.watcher.start()

    def _watch(self) -> None:
        """Until stopped or failed: a closed worker connection (not a stranger's failed handshake) or a finished
        `run` call is a dead worker."""
        workers, monitor = self.workers, self._monitor
        stranger = False
        try:
            while not workers.stop.is_set() and self.failure_reason is None:
                if monitor.poll(POLL_MS):
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED and not stranger:
                        self._fail(f"a Ray worker's connection to the engine ({event['endpoint'].decode()}) closed: "
                                   "its process or its node is gone")
                    stranger = bool(event["event"] & _HANDSHAKE_FAILED)
                    continue
                done, _ = ray.wait(workers.run_refs, num_returns=1, timeout=0, fetch_local=False)
                if done:
                    rank = workers.run_refs.index(done[0])
                    self._fail(f"worker {rank} (Ray actor on {self.nodes[rank][1]}) exited unexpectedly "
                               f"({_outcome(done[0])})")
        finally:
            monitor.close(linger=0)

    # ---- stop ------------------------------------------------------------------------------------
    @staticmethod
    def _stop_workers(ctx: zmq.Context, workers: _RayWorkers) -> None:  # type: ignore[override]
        """Let the loops return (Shutdown was sent if they were healthy), then kill the actors and remove the
        placement group; a dead node's actors are gone already."""
        workers.stop.set()
        if workers.watcher is not None and workers.watcher is not threading.current_thread():
            workers.watcher.join(timeout=2.0)
        try:
            if workers.run_refs:
                ray.wait(workers.run_refs, num_returns=len(workers.run_refs), timeout=2.0, fetch_local=False)
            for actor in workers.actors:
                ray.kill(actor, no_restart=True)
            if workers.placement_group is not None:
                remove_placement_group(workers.placement_group)
        except Exception as e:  # Ray already shut down (at exit), or its cluster gone
            logger.warning("stopping the Ray workers: %s: %s", type(e).__name__, e)
        ctx.destroy(linger=0)
        if workers.owns_ray:
            ray.shutdown()


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _outcome(ref) -> str:
    """How a finished RayWorker.run call ended, in one line."""
    try:
        return f"its loop returned {ray.get(ref, timeout=5.0)}"
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first}"[:500]

