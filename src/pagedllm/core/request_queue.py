"""The waiting queue, in scheduling-policy order (fcfs, or priority then arrival; slo: core/slo_queue.py)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedllm.core.request import Request
from pagedllm.core.slo_queue import SLORequestQueue


class FCFSRequestQueue:
    """First come first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest `priority` value first, then earliest arrival, then insertion order.

    A preempted request re-enters at its own (priority, arrival) rank, which puts it ahead of every
    request that arrived after it with the same priority: the front, for equal priorities.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting.")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def create_request_queue(policy: str, slo_max_wait_s: float = 30.0
                         ) -> FCFSRequestQueue | PriorityRequestQueue | SLORequestQueue:
    """The waiting queue for a SchedulerConfig.scheduling_policy ("fcfs", "priority" or "slo": core/slo_queue.py)."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "slo":
        return SLORequestQueue(slo_max_wait_s)
    raise ValueError(f"scheduling policy must be fcfs, priority or slo, got {policy!r}.")
