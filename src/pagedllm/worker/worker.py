"""Worker: one rank's model, KV cache and ModelRunner, driven by an executor (executor/).

The uni executor holds one Worker in the engine process; the mp executor runs one per process
(executor/worker_proc.py). Every rank loads only its tensor-parallel share of the weights, or its pipeline
stage's layers, and allocates its share of the KV cache; only the driver rank (the last stage's first
tensor-parallel rank: 0 without pipeline parallelism) returns the sampled tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections import deque

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel_group,
    init_tensor_parallel_group,
)
from pagedllm.distributed.pipeline_parallel import PipelineParallelGroup, destroy_world, init_pipeline
from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedllm.kv_transfer.factory import create_kv_connector
from pagedllm.layers.forward_context import kv_cache_bytes_per_block
from pagedllm.layers.kv_cache_dtype import resolve_kv_cache_dtype
from pagedllm.messages import ModelRunnerOutput
from pagedllm.models.loader import load_model, resolve_device, resolve_dtype, resolve_model
from pagedllm.models.model_info import ModelInfo
from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer
from pagedllm.structured_output.manager import GrammarOutput
from pagedllm.tokenizer import get_tokenizer, tokenizer_source
from pagedllm.worker.cpu_allocator import release_freed_memory
from pagedllm.worker.kv_connector_step import layer_kv_caches, run_with_connector
from pagedllm.worker.kv_scales import CALIBRATION_TEXT, calculate_kv_scales
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
STEP_SPANS_KEPT = 256


class Worker:
    """Args:
        config: the engine's configuration (every rank gets the same).
        rank: this worker's rank (pipeline stage rank // tensor-parallel size, tensor-parallel rank the rest)
        distributed_init_method: torch.distributed's rendezvous (e.g. tcp://127.0.0.1:PORT); None at size 1.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None):
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.tp = TensorParallelGroup.single()
        self.pp = PipelineParallelGroup.single()
        pc = config.parallel_config
        self.is_driver = rank == pc.world_size - pc.tensor_parallel_size
        """Whether this rank returns the step's output: the last stage's first tensor-parallel rank."""
        self.model_runner: ModelRunner | None = None
        self.draft_model: torch.nn.Module | None = None
        self.draft_scratch_bytes = 0
        """Bytes of the draft model's scratch KV cache (draft_model method), taken from the KV budget."""
        self.num_blocks = 0
        """The KV pool's size in blocks (set by initialize_kv_cache; wake_up allocates the same again)."""
        self.kv_cache_asleep = False
        """Sleep mode: the pool is dropped and not yet woken (engine/sleep_mode.py)."""
        self.heap_was_frozen = False
        """Sleep mode: the heap was frozen (gc_heap.py) before sleep unfroze it; wake_up freezes it again."""
        self.step_spans: deque[tuple[float, float]] = deque(maxlen=STEP_SPANS_KEPT)
        self.kv_connector: KVConnectorBase | None = None
        """The KV connector's worker side (kv_transfer/), made once the KV cache exists; None without one."""
        self.kv_by_layer: dict = {}
        """The pool's tensors by connector layer name (kv_connector_step.layer_kv_caches), set with the pool."""

    def init_device(self) -> None:
        """Resolve the device and dtype; join the tensor-parallel group or the pipeline (all ranks at once)."""
        mc, pc = self.config.model_config, self.config.parallel_config
        self.device = resolve_device(mc.device)
        if self.device.type == "cuda" and pc.world_size > 1:
            self.device = torch.device("cuda", self.rank)
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(mc.dtype, self.device, mc)
        if pc.pipeline_parallel_size > 1:
            self.tp, self.pp = init_pipeline(self.rank, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                             self.distributed_init_method or "", self.device)
        else:
            self.tp = init_tensor_parallel_group(self.rank, pc.tensor_parallel_size,
                                                 self.distributed_init_method or "", self.device)
        self.tp = dataclasses.replace(self.tp, expert_parallel=pc.enable_expert_parallel)

    def load_model(self) -> None:
        """Load this rank's share of the weights and build the runner (before the KV cache exists)."""
        mc, cc = self.config.model_config, self.config.cache_config
        torch.manual_seed(mc.seed)
        model = load_model(mc, self.device, self.dtype, self.tp, self.pp)
        self.model_info: ModelInfo = model.info
        self.max_model_len = resolve_max_model_len(mc.max_model_len, model.info.max_position_embeddings)
        self.kv_cache_dtype = resolve_kv_cache_dtype(cc.kv_cache_dtype, self.dtype, self.device)
        self.draft_model = self._load_draft_model()
        self.model_runner = ModelRunner(self.config, model, model.info, self.device, self.dtype, self.kv_cache_dtype,
                                        max_model_len=self.max_model_len, num_kv_heads=model.num_kv_heads,
                                        tp_size=self.tp.size, pp=self.pp, draft_model=self.draft_model)

    def _load_draft_model(self) -> torch.nn.Module | None:
        """The draft_model method's model, through the same loader and dtype as the target; None for other methods.

        Raises:
            ValueError: tensor parallelism, or a draft whose tokenizer differs from the target's (naming both).
        """
        spec, mc = self.config.speculative_config, self.config.model_config
        if spec is None or spec.method != "draft_model":
            return None
        if self.tp.size > 1 or self.pp.size > 1:
            raise ValueError("speculative method 'draft_model' runs only at --tensor-parallel-size 1 and "
                             "--pipeline-parallel-size 1.")
        target_vocab = get_tokenizer(tokenizer_source(mc, resolve_model(mc))).get_vocab()
        draft_vocab = get_tokenizer(resolve_model(spec.model, None, mc.download_dir)).get_vocab()
        if draft_vocab != target_vocab:
            raise ValueError(f"the draft model {spec.model!r} does not share the target model {mc.model!r}'s "
                             f"tokenizer ({len(draft_vocab)} vs {len(target_vocab)} tokens, "
                             f"{sum(draft_vocab.get(t) != i for t, i in target_vocab.items())} differ); "
                             "draft_model needs a draft with the same vocabulary.")
        draft = load_model(dataclasses.replace(mc, model=spec.model, revision=None, tokenizer=None, quantization=None),
                           self.device, self.dtype)
        if draft.info.vocab_size != self.model_info.vocab_size:
            raise ValueError(f"the draft model {spec.model!r} has {draft.info.vocab_size} logits, the target model "
                             f"{mc.model!r} {self.model_info.vocab_size}; draft_model needs the same vocabulary.")
        if draft.info.max_position_embeddings < self.max_model_len:
            raise ValueError(f"the draft model {spec.model!r} handles {draft.info.max_position_embeddings} positions, "
                             f"fewer than --max-model-len {self.max_model_len}.")
        self.draft_scratch_bytes = DraftModelProposer.scratch_bytes(
            draft.info, draft.num_kv_heads, self.dtype, self.max_model_len, self.config.cache_config.block_size)
        logger.info("Draft model %s loaded: %d layers, %d drafts per step, %.1f MiB of scratch KV (taken from the "
                    "KV cache budget)", spec.model, draft.info.num_layers, spec.num_speculative_tokens,
                    self.draft_scratch_bytes / 2**20)
        return draft

    def get_model_info(self) -> ModelInfo:
        return self.model_info

    # ---- KV cache --------------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        """KV blocks this rank's budget holds (--kv-cache-memory is per rank, as vLLM's is per GPU)."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        # the draft model's scratch KV comes out of the same budget
        return max(0, self._kv_cache_budget() - self.draft_scratch_bytes) // self.kv_cache_spec()[0]

    def kv_cache_spec(self) -> tuple[int, str]:
        """(bytes one KV block takes on this rank, the pool's storage dtype), for the start-up log. With several KV
        cache groups a block holds one page per tensor of the pool (core/kv_cache_spec.py), not one per layer."""
        cc = self.config.cache_config
        per_block = kv_cache_bytes_per_block(cc.block_size, self.model_runner.num_kv_heads, self.model_info.head_dim,
                                             self.kv_cache_dtype, self.model_runner.num_kv_cache_tensors)
        return per_block, str(self.kv_cache_dtype).removeprefix("torch.")

    def _kv_cache_budget(self) -> int:
        cc = self.config.cache_config
        if self.device.type == "cuda" and cc.kv_cache_memory is None:
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return max(0, int(total * cc.gpu_memory_utilization) - used - (1 << 30))
        return cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.config.kv_transfer_config is not None and self.kv_connector is None:
            ktc = self.config.kv_transfer_config
            self.kv_connector = create_kv_connector(self.config, KVConnectorRole.WORKER,
                                                    (ktc.kv_rank or 0, self.tp.rank, self.tp.size))
            self._register_pool()

    def _register_pool(self) -> None:
        self.kv_by_layer = layer_kv_caches(self.model_runner.kv_caches, 0)  # no pipeline parallelism here
        self.kv_connector.register_kv_caches(self.kv_by_layer)

    # ---- sleep mode (engine/sleep_mode.py) ------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Drop the weights and the KV pool (the runner that holds both) and give the memory back to the OS; the
        process, its device and its tensor-parallel group stay. Levels 1 and 2 do the same here (see
        engine/sleep_mode.py)."""
        runner, self.model_runner, self.draft_model = self.model_runner, None, None
        if self.kv_connector is not None:  # it lets go of the pool (its copies in flight end first)
            self.kv_by_layer = {}
            self.kv_connector.register_kv_caches({})
        if runner is not None:
            if runner.kv_prefault is not None:
                runner.kv_prefault.stop()
            runner.kv_caches.clear()
            del runner
        self.kv_cache_asleep = True
        # A server froze its start-up heap, the model with it (gc_heap.py): a cycle in it is only collected unfrozen
        self.heap_was_frozen = gc.get_freeze_count() > 0
        gc.unfreeze()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        release_freed_memory()

    def wake_up(self, *tags: str) -> None:
        """"weights": load this rank's weights again (a new runner); "kv_cache": allocate the pool again, with the
        same number of blocks (now, or once the weights are back); no tags: both."""
        tags = tags or ("weights", "kv_cache")
        reloaded = False
        if "weights" in tags and self.model_runner is None:
            self.load_model()
            reloaded = True
        if "kv_cache" in tags:
            self.kv_cache_asleep = False
        runner = self.model_runner
        if runner is not None and not self.kv_cache_asleep and not runner.kv_caches:
            runner.initialize_kv_cache(self.num_blocks)
            reloaded = True
            if self.kv_connector is not None:  # the new pool
                self._register_pool()
        if reloaded and runner is not None and runner.kv_caches and self.config.cache_config.kv_scales_calculated:
            self.calculate_kv_scales()
        if reloaded and self.heap_was_frozen:  # out of the collector's reach again, as at start-up (gc_heap.py)
            gc.collect()
            gc.freeze()

    def calculate_kv_scales(self) -> None:
        """--calculate-kv-scales: every attention layer's k_scale and v_scale from the fixed calibration text (with
        tensor parallelism, each rank's from its own KV heads; with pipeline parallelism, each stage's layers, all
        stages at once)."""
        mc = self.config.model_config
        tokenizer = get_tokenizer(tokenizer_source(mc, resolve_model(mc)))
        token_ids = tokenizer.encode(CALIBRATION_TEXT.read_text())[: self.max_model_len]
        start = time.perf_counter()
        scales = calculate_kv_scales(self.model_runner.model, token_ids, self.device, self.dtype, self.pp)
        logger.info("KV cache scales calculated from %d calibration tokens in %.1f s: k_scale %s, v_scale %s",
                    len(token_ids), time.perf_counter() - start, sorted({k for k, _ in scales}),
                    sorted({v for _, v in scales}))

    def wait_kv_cache_resident(self) -> None:
        """Block until the background prefault has faulted the KV pool in (CPU; a no-op elsewhere)."""
        if self.model_runner.kv_prefault is not None:
            start = time.perf_counter()
            self.model_runner.kv_prefault.wait()
            logger.info("KV cache resident in %.1f s", time.perf_counter() - start)

    # ---- steps -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: GrammarOutput | None = None) -> ModelRunnerOutput | None:
        """Run one step (`grammar`: this step's token bitmask); the driver rank returns the output, the others
        None."""
        runner = self.model_runner
        prefault = runner.kv_prefault
        start = time.monotonic()
        report = None
        with prefault.busy() if prefault is not None else contextlib.nullcontext():
            if self.kv_connector is None:
                output = runner.execute_model(scheduler_output, grammar)
            else:
                output, report = run_with_connector(self.kv_connector, self.kv_by_layer, scheduler_output,
                                                    lambda: runner.execute_model(scheduler_output, grammar))
        self.step_spans.append((start, time.monotonic()))
        if report is not None:
            if not self.is_driver:  # every rank's report goes back (executor/kv_output_aggregator.py)
                return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], kv_connector_output=report)
            output.kv_connector_output = report
        return output if self.is_driver else None

    def get_step_spans(self) -> list[tuple[float, float]]:
        """(start, end) on the host's monotonic clock of this rank's latest steps (at most STEP_SPANS_KEPT, oldest
        first): with pipeline parallelism the stages' spans overlap (tests and diagnostics)."""
        return list(self.step_spans)

    def check_health(self) -> None:
        """Raises if this worker cannot run steps (nothing to check in-process today)."""

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        runner = self.model_runner
        if runner is not None:
            if runner.kv_prefault is not None:
                runner.kv_prefault.stop()
            runner.kv_caches.clear()
        destroy_tensor_parallel_group(self.tp)
        if self.pp.size > 1:
            destroy_world()


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    if requested is None:
        return model_max
    if requested < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {requested}.")
    if requested > model_max:
        raise ValueError(f"--max-model-len {requested} is larger than the model's context length {model_max}.")
    return requested
