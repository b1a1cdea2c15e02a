"""Sleep mode (vLLM's `--enable-sleep-mode`, `/sleep`, `/wake_up`, `/is_sleeping`): EngineCore's side.

    sleep(level)   every request still open is aborted (vLLM's default pause mode, "abort"), the scheduler stops
                   scheduling, and at level 1 or 2 the prefix cache is forgotten and every rank drops its weights
                   and its KV pool (Worker.sleep): the memory goes back to the OS, the processes stay.
    wake_up(tags)  "weights": every rank loads its weights again from the model's files; "kv_cache": the pool is
                   allocated again (same number of blocks); no tags: both. Scheduling resumes once both are back
                   ("scheduling" alone resumes a level-0 sleep).

vLLM's level 1 offloads the weights to CPU memory and level 2 discards them; on a CPU engine there is no device
memory to offload from, so both levels drop the weights and reload them from disk on wake (the same memory is
freed either way). Level 0 only pauses scheduling (no memory changes, no --enable-sleep-mode needed), as vLLM's.
Requests that arrive while the engine sleeps wait in the waiting queue and run after wake_up, as in vLLM (whose
scheduler queues new requests while paused).
"""

from __future__ import annotations

import logging
import time

from pagedllm.core.request import RequestStatus
from pagedllm.messages import EngineCoreOutput, FinishReason

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")
"""What a level 1 or 2 sleep drops, by vLLM's tag names (the tags /wake_up takes)."""
WAKE_UP_TAGS = (*SLEEP_TAGS, "scheduling")


class SleepMode:
    """Mixed into EngineCore (which provides config, scheduler, executor, batch_queue and _apply)."""

    paused: bool = False
    """Scheduling is paused: nothing is scheduled, new requests wait (set by sleep, cleared by a full wake_up)."""
    sleeping_tags: frozenset[str] = frozenset()
    """What is dropped now: a subset of SLEEP_TAGS."""

    def sleep(self, level: int = 1) -> list[EngineCoreOutput]:
        """Pause and, at level >= 1, drop the weights and the KV pool. Returns the outputs that finish the requests
        it aborted (and those of steps still in flight), for the frontend.

        Raises ValueError (nothing changed) for a level outside 0-2, or level >= 1 without --enable-sleep-mode."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2; got {level}.")
        if level >= 1 and not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep levels 1 and 2 need the server started with --enable-sleep-mode.")
        outputs = self._finish_steps_in_flight()
        open_ids = list(self.scheduler.requests)
        self.scheduler.finish_requests(open_ids, RequestStatus.FINISHED_ABORTED)
        outputs += [EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ABORT)
                    for r in open_ids]
        self.paused = True
        if level >= 1 and "weights" not in self.sleeping_tags:  # (asleep already: nothing more to drop, as vLLM's)
            self.reset_prefix_cache()  # the pool's contents are about to go: no block may be found again
            start = time.perf_counter()
            self.executor.collective_rpc("sleep", (level,))
            self.sleeping_tags = frozenset(SLEEP_TAGS)
            logger.info("Asleep (level %d) in %.2f s: weights and KV pool dropped, %d requests aborted", level,
                        time.perf_counter() - start, len(open_ids))
        else:
            logger.info("Scheduling paused (sleep level %d), %d requests aborted", level, len(open_ids))
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back `tags` (None: everything). Returns whether the engine is fully awake (scheduling resumed).

        Raises ValueError for a tag that is not one of WAKE_UP_TAGS."""
        unknown = [t for t in tags or () if t not in WAKE_UP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tag {unknown[0]!r}; the tags are {', '.join(WAKE_UP_TAGS)}.")
        wanted = set(SLEEP_TAGS if tags is None else tags) & self.sleeping_tags
        if wanted:
            start = time.perf_counter()
            self.executor.collective_rpc("wake_up", tuple(sorted(wanted)))
            self.sleeping_tags = self.sleeping_tags - wanted
            logger.info("Woke up %s in %.2f s", ", ".join(sorted(wanted)), time.perf_counter() - start)
        if not self.sleeping_tags:
            self.paused = False
        return not self.paused

    def is_sleeping(self) -> bool:
        """Asleep at any level (scheduling paused, or weights or KV pool dropped), as vLLM's is_sleeping."""
        return self.paused or bool(self.sleeping_tags)

    def _finish_steps_in_flight(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism: apply the steps still in flight (their ranks are using the weights)."""
        outputs: list[EngineCoreOutput] = []
        while self.batch_queue:
            future, scheduler_output = self.batch_queue.popleft()
            outputs += self._apply(scheduler_output, future.result()).outputs
        return outputs
