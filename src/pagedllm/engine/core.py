"""EngineCore: the loop body every frontend drives: schedule -> execute -> update.

It owns the Scheduler (and through it the KV cache manager) and the ModelRunner. Only the thread that
calls `step()` touches scheduler or KV state. The offline LLM calls it in-process; the server runs it in
its own process (engine/core_proc.py) behind ZMQ sockets.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.layers.forward_context import kv_cache_bytes_per_block
from pagedllm.layers.kv_cache_dtype import resolve_kv_cache_dtype
from pagedllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelLimits,
    SchedulerStats,
)
from pagedllm.models.loader import load_model, resolve_device, resolve_dtype, resolve_model
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import get_tokenizer
from pagedllm.worker.kv_scales import CALIBRATION_TEXT, calculate_kv_scales
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


class EngineCore:
    """Loads the model, sizes the KV pool, and runs steps.

    Raises ValueError at construction when the configuration cannot work (e.g. one request of
    max_model_len tokens does not fit in the KV pool: the scheduler's KVCacheManager checks, after the pool's
    size in blocks, tokens and MiB is logged).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        start = time.perf_counter()
        self.resolved_model = resolve_model(mc.model)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        torch.manual_seed(mc.seed)
        model = load_model(mc, self.device, self.dtype)
        info = self.model_info = model.info
        self.max_model_len = _resolve_max_model_len(mc.max_model_len, info.max_position_embeddings)
        """The one resolved value: the scheduler, the runner and the frontend (ModelLimits) all get it from here."""
        self.kv_cache_dtype = resolve_kv_cache_dtype(cc.kv_cache_dtype, self.dtype, self.device)
        self.num_blocks = self._determine_num_blocks()
        # Before the KV cache is allocated: the scheduler refuses a pool that cannot hold one longest request.
        self.scheduler = Scheduler(sc, cc, self.num_blocks, self.max_model_len, config.speculative_config)
        self.runner = ModelRunner(config, model, info, self.device, self.dtype, self.kv_cache_dtype,
                                  max_model_len=self.max_model_len)
        self.runner.initialize_kv_cache(self.num_blocks)
        if cc.kv_scales_calculated:
            self._calculate_kv_scales()
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs_config, self._load_tokenizer, self.vocab_size)
        logger.info("EngineCore ready in %.1f s: %s on %s in %s", time.perf_counter() - start,
                    self.resolved_model.path, self.device, str(self.dtype).removeprefix("torch."))

    # ---- facts the frontend needs ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    def model_limits(self) -> ModelLimits:
        eos_ids = list(self.model_info.eos_token_ids)
        return ModelLimits(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                           eos_token_id=eos_ids[0] if eos_ids else None, extra_stop_token_ids=eos_ids[1:],
                           generation_defaults=self._generation_defaults(),
                           grammar_compile_timeout_s=self.config.structured_outputs_config.compile_timeout_s)

    def cache_config_info(self) -> dict[str, str]:
        """The labels of vLLM's `vllm:cache_config_info` gauge (its CacheConfig's names, values as strings): the
        pool's token capacity is num_gpu_blocks * block_size."""
        cc = self.config.cache_config
        return {"block_size": str(cc.block_size), "cache_dtype": cc.kv_cache_dtype,
                "enable_prefix_caching": str(cc.enable_prefix_caching),
                "calculate_kv_scales": str(cc.kv_scales_calculated),
                "gpu_memory_utilization": str(cc.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(cc.kv_cache_memory), "num_gpu_blocks": str(self.num_blocks),
                "num_gpu_blocks_override": str(cc.num_gpu_blocks_override)}

    def _generation_defaults(self) -> dict:
        return dict(self.model_info.generation_config or {})  # the loader honours --generation-config

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request. Raises QueueFullError when the waiting queue is at its cap."""
        req = Request.from_engine_core_request(request, self.config.cache_config.block_size)
        if request.sampling_params.structured_outputs is not None:
            req.structured_output_request = self.structured_output_manager.add_request(
                request.sampling_params.structured_outputs)
            req.status = RequestStatus.WAITING_FOR_FSM
        self.scheduler.add_request(req)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and update once. With nothing to run, returns outputs with stats only."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time())
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.num_scheduled_tokens and self.scheduler.waiting:
            time.sleep(0.001)  # e.g. every request waits for its grammar: no busy spin while it compiles
        prefault = self.runner.kv_prefault
        try:
            with prefault.busy() if prefault is not None else contextlib.nullcontext():
                grammar = self.structured_output_manager.grammar_bitmask(self.scheduler.requests, scheduler_output)
                runner_output = self.runner.execute_model(scheduler_output, grammar)
        except Exception:
            logger.exception("model execution failed; failing the %d requests of this step",
                             len(scheduler_output.num_scheduled_tokens))
            return self._fail_requests(list(scheduler_output.num_scheduled_tokens))
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.scheduler_stats = self.make_stats()
        return outputs

    def make_stats(self) -> SchedulerStats:
        """The scheduler's snapshot with the grammar compiles since the last one."""
        stats = self.scheduler.make_stats()
        grammar = self.structured_output_manager.take_stats()
        stats.grammar_compiles_delta = grammar.num_compiles
        stats.grammar_compile_seconds_delta = grammar.compile_seconds
        stats.grammar_cache_hits_delta = grammar.num_cache_hits
        return stats

    def _fail_requests(self, req_ids: list[str]) -> EngineCoreOutputs:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        outputs = [EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ERROR,
                                    error="The engine failed while running this request.") for r in req_ids]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.time())

    def wait_kv_cache_resident(self) -> None:
        """Block until the background prefault has faulted the KV pool in (CPU; a no-op elsewhere)."""
        if self.runner.kv_prefault is not None:
            start = time.perf_counter()
            self.runner.kv_prefault.wait()
            logger.info("KV cache resident in %.1f s", time.perf_counter() - start)

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        if self.runner.kv_prefault is not None:
            self.runner.kv_prefault.stop()
        self.runner.kv_caches.clear()

    def _load_tokenizer(self):
        return get_tokenizer(self.config.model_config.tokenizer or self.resolved_model)

    def _calculate_kv_scales(self) -> None:
        """--calculate-kv-scales: every attention layer's k_scale and v_scale from the fixed calibration text."""
        tokenizer = self._load_tokenizer()
        token_ids = tokenizer.encode(CALIBRATION_TEXT.read_text())[: self.max_model_len]
        start = time.perf_counter()
        scales = calculate_kv_scales(self.runner.model, token_ids, self.device, self.dtype)
        logger.info("KV cache scales calculated from %d calibration tokens in %.1f s: k_scale %s, v_scale %s",
                    len(token_ids), time.perf_counter() - start, sorted({k for k, _ in scales}),
                    sorted({v for _, v in scales}))

    # ---- sizing ----------------------------------------------------------------------------------
    def _determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        info = self.model_info
        per_block = kv_cache_bytes_per_block(cc.block_size, info.num_kv_heads, info.head_dim, self.kv_cache_dtype,
                                             info.num_layers)
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            num_blocks = self._kv_cache_budget() // per_block
        num_tokens = num_blocks * cc.block_size
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s); maximum concurrency at "
                    "max_model_len %d: %.2fx", num_blocks, cc.block_size, num_tokens,
                    num_blocks * per_block / (1 << 20), str(self.kv_cache_dtype).removeprefix("torch."),
                    self.max_model_len, num_tokens / self.max_model_len)
        return num_blocks

    def _kv_cache_budget(self) -> int:
        cc = self.config.cache_config
        if self.device.type == "cuda" and cc.kv_cache_memory is None:
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return max(0, int(total * cc.gpu_memory_utilization) - used - (1 << 30))
        return cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES


def _resolve_max_model_len(requested: int | None, model_max: int) -> int:
    if requested is None:
        return model_max
    if requested < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {requested}.")
    if requested > model_max:
        raise ValueError(f"--max-model-len {requested} is larger than the model's context length {model_max}.")
    return requested
