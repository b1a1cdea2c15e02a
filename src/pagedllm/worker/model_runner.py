"""ModelRunner: applies the scheduler's diffs to the persistent batch, runs one flattened forward pass
over every scheduled token (prefill chunks and decodes together), and samples.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
from pagedllm.distributed.pipeline_parallel import PipelineParallelGroup, run_stage
from pagedllm.kernels import cpu_kernels
from pagedllm.layers.forward_context import AttentionMetadata, get_forward_context, kv_cache_shape, set_forward_context
from pagedllm.layers.fused_moe import routed_token_counter
from pagedllm.layers.sampler import Sampler, build_sampling_metadata, compute_prompt_logprobs, logprobs_to_entries
from pagedllm.layers.sampling.grammar_bitmask import apply_grammar_bitmask
from pagedllm.layers.sampling.rejection_sampler import rejection_sample
from pagedllm.lora.manager import LoRAManager
from pagedllm.math_utils import cdiv
from pagedllm.messages import LogprobsEntry, ModelRunnerOutput
from pagedllm.models.llama_native_step import LlamaNativeDecodeStep
from pagedllm.models.registry import kv_cache_layout
from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer
from pagedllm.structured_output.manager import GrammarOutput
from pagedllm.worker.cpu_allocator import PoolPrefault, keep_freed_memory, zeroed_pool
from pagedllm.worker.input_batch import InputBatch, RequestState
from pagedllm.worker.pooling import Pooler

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_info, device: torch.device,
                 dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None, *, max_model_len: int,
                 num_kv_heads: int | None = None, tp_size: int = 1, pp: PipelineParallelGroup | None = None,
                 draft_model: torch.nn.Module | None = None):
        self.config = config
        self.model = model
        self.info = model_info
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # the pool's storage dtype (layers/kv_cache_dtype.py)
        self.block_size = config.cache_config.block_size
        self.num_kv_heads = num_kv_heads or model_info.num_kv_heads
        """KV heads this rank caches (its tensor-parallel share)."""
        self.pp = pp or PipelineParallelGroup.single()
        self.num_layers = getattr(model, "num_layers", model_info.num_layers)
        """Layers this rank runs and caches (its pipeline stage's)."""
        self.kv_cache_layout = kv_cache_layout(model_info, config.scheduler_config.disable_hybrid_kv_cache_manager)
        """The model's KV cache groups (core/kv_cache_spec.py): with several, each has its own block table."""
        first_layer = self.pp.layers(model_info.num_layers)[0] if self.pp.size > 1 else 0
        self.layer_groups = np.array([self.kv_cache_layout.layer_group(first_layer + i)
                                      for i in range(self.num_layers)], dtype=np.int64)
        """This rank's layer i -> its KV cache group."""
        self.layer_tensors = [self.kv_cache_layout.layer_tensor(first_layer + i) for i in range(self.num_layers)]
        """This rank's layer i -> which of the pool's tensors holds its K/V (the layer's place in its group)."""
        num_groups = self.kv_cache_layout.num_groups
        self.input_batch = InputBatch(config.scheduler_config.max_num_seqs, max_model_len, self.block_size,
                                      num_groups)
        self.sampler = Sampler(config.model_config.logprobs_mode)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_prefault: PoolPrefault | None = None
        # Generators of seeded requests survive preemption: sampling resumes where it stopped.
        self.generators: dict[str, torch.Generator] = {}
        self.pooler = Pooler()
        """Pooling requests (runner pooling): their rows are pooled into a vector instead of sampled."""
        self.grammar: GrammarOutput | None = None
        """This step's token bitmask (structured outputs), set by execute_model."""
        # One native call runs every layer: no room for the all-reduces of tensor parallelism, nor for a stage.
        native = device.type == "cpu" and tp_size == 1 and self.pp.size == 1
        if native and num_groups > 1:
            logger.info("%s: %d KV cache groups (sliding-window and full-attention layers); the native decode step "
                        "reads one block table: decode steps run the model's modules", model_info.architecture,
                        num_groups)
            native = False
        self.native_step = LlamaNativeDecodeStep.build(model) if native else None
        self.routed_tokens = routed_token_counter(model, device)
        """A mixture of experts: [E] tokens routed to each expert in this step's forward (all layers), else None."""
        self.lora_manager = LoRAManager(model, config.lora_config, model_info, dtype) \
            if config.lora_config.enable_lora else None
        """--enable-lora: the adapters, and each step's rows grouped by adapter (lora/manager.py)."""
        self.speculative_config = config.speculative_config
        self.proposer = _make_proposer(config.speculative_config, draft_model, device, dtype, max_model_len,
                                       self.block_size, config.scheduler_config.max_num_batched_tokens)

    @property
    def num_kv_cache_tensors(self) -> int:
        """Tensors of [2, num_blocks, ...] this rank's pool has: one per layer, or with several KV cache groups one
        per place in a group that this rank's layers use (layers of different groups share them)."""
        return len(set(self.layer_tensors))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.info.head_dim)
        tensors = {j: _zeros(shape, self.kv_cache_dtype, self.device) for j in sorted(set(self.layer_tensors))}
        self.kv_caches = [tensors[j] for j in self.layer_tensors]
        if self.device.type == "cpu":
            keep_freed_memory()  # after the pool (its own calloc'd mmaps): step temporaries reuse the heap
            # Fault the pool in from a background thread while the engine idles, K and V of every layer in
            # block order (the block pool hands out low ids first); EngineCore.step marks it busy.
            self.kv_prefault = PoolPrefault([half for kv in tensors.values() for half in kv])
            # Build (first run on this machine, under a second) or load the native kernels now, not on the
            # first request; logs and falls back to the torch paths if there is no compiler.
            cpu_kernels.available(self.dtype, self.device)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Run one step. `grammar`: the token bitmask of the rows that sample under a grammar, applied to their
        logits before the sampler.

        Returns:
            sampled token ids for every scheduled request, in the order of so.num_scheduled_tokens
            ([] for a request whose prefill chunk does not reach the end of its tokens).
        """
        self._update_states(so)
        self.grammar = grammar
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = self.input_batch
        if self.lora_manager is not None:  # each adapter's rows together: one slice of the batch per adapter
            req_ids.sort(key=lambda r: self.lora_manager.sort_key(batch.states[batch.req_id_to_row[r]]))
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        spec = so.scheduled_spec_decode_tokens
        num_drafts = self._write_drafts(spec, req_ids) if spec else None
        input_ids, positions, attn_metadata = self._prepare_inputs(rows, num_sched)
        if num_drafts is not None:
            attn_metadata.verify_reqs = np.flatnonzero(num_drafts)
        layer_metadata = self._layer_metadata(attn_metadata, rows) if self.kv_cache_layout.num_groups > 1 else None
        if self.routed_tokens is not None:
            self.routed_tokens.zero_()
        lora = None if self.lora_manager is None else self.lora_manager.mapping(
            [batch.states[r].lora_request for r in rows.tolist()], num_sched)
        with set_forward_context(attn_metadata, self.kv_caches, layer_metadata, lora):
            hidden_states = self._forward(input_ids, positions)  # [T, hidden]
        if hidden_states is None:  # a pipeline stage before the last: the tokens come in the next step's diffs
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])

        # A request samples when this step's tokens reach the end of the tokens it has (a pooling request pools).
        seq_lens = batch.num_computed_tokens[rows] + num_sched
        sampling = np.flatnonzero(seq_lens >= batch.num_tokens[rows])  # indices into req_ids
        pooled: dict[str, list[float]] = {}
        if self.pooler.requests:
            sampling = np.array([i for i in sampling.tolist() if not self.pooler.is_pooling(req_ids[i])],
                                dtype=np.int64)
            pooled = self.pooler.collect(req_ids, batch.num_computed_tokens[rows], num_sched,
                                         attn_metadata.query_start_loc_cpu, hidden_states)
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, list[LogprobsEntry]] = {}
        if len(sampling) and num_drafts is not None:
            self._sample_verify(hidden_states, attn_metadata.query_start_loc_cpu, req_ids, rows, sampling, num_drafts,
                                spec, sampled_token_ids, logprobs)
        elif len(sampling):
            last_idx = attn_metadata.query_start_loc_cpu[1:][sampling] - 1
            logits = self.model.compute_logits(hidden_states[torch.from_numpy(last_idx).to(self.device)])
            sample_rows = rows[sampling]
            tokens, entries = self._sample(logits, sample_rows)
            for i, row, token, entry in zip(sampling.tolist(), sample_rows.tolist(), tokens, entries,
                                            strict=True):
                sampled_token_ids[i] = [token]
                batch.append_token(row, token)
                if entry is not None:
                    logprobs[req_ids[i]] = [entry]
        prompt_logprobs = self._prompt_logprobs(req_ids, rows, num_sched, attn_metadata, hidden_states)
        routed = None if self.routed_tokens is None else self.routed_tokens.tolist()
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs,
                                 spec_token_ids=self._propose(rows, sampling) if self.proposer else None,
                                 expert_routed_tokens=routed, pooler_output=pooled)

    # ---- speculative decoding -------------------------------------------------------------------------
    def _write_drafts(self, spec: dict[str, list[int]], req_ids: list[str]) -> np.ndarray:
        """Put each request's drafts after its tokens (not counted in num_tokens: they are guesses).

        Returns:
            [R] drafts per scheduled request (0 for most).
        """
        batch = self.input_batch
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            drafts = spec.get(req_id)
            if drafts:
                row = batch.req_id_to_row[req_id]
                n = batch.num_tokens[row]
                batch.token_ids[row, n:n + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        return num_drafts

    def _sample_verify(self, hidden_states: torch.Tensor, query_start_loc: np.ndarray, req_ids: list[str],
                       rows: np.ndarray, sampling: np.ndarray, num_drafts: np.ndarray, spec: dict[str, list[int]],
                       sampled_token_ids: list[list[int]], logprobs: dict[str, list[LogprobsEntry]]) -> None:
        """Sample a step that verifies drafts: logits at every verify row, then the rejection sampler for requests
        with drafts and the plain sampler for the others (whose logits are computed in the same call). A constrained
        request's verify rows are masked first, each with the grammar's state after the drafts before it.

        Example: sampling requests with drafts [0, 2] ending at rows 5 and 9 -> logits rows [4, 7, 8, 9]."""
        batch = self.input_batch
        counts = num_drafts[sampling] + 1  # [S] logits rows per sampling request
        first = np.zeros(len(sampling) + 1, dtype=np.int64)  # [S + 1] their start in the logits
        np.cumsum(counts, out=first[1:])
        ends = query_start_loc[1:][sampling]  # [S] one past each request's last row
        idx = np.repeat(ends - counts, counts) + np.arange(int(first[-1])) - np.repeat(first[:-1], counts)
        logits = self.model.compute_logits(hidden_states[torch.from_numpy(idx).to(self.device)])  # [sum counts, V]
        sample_rows = rows[sampling]
        plain = np.flatnonzero(counts == 1)
        verify = np.flatnonzero(counts > 1)
        if len(plain):
            tokens, entries = self._sample(logits[torch.from_numpy(first[plain]).to(self.device)], sample_rows[plain])
            for j, token, entry in zip(plain.tolist(), tokens, entries, strict=True):
                sampled_token_ids[int(sampling[j])] = [token]
                if entry is not None:
                    logprobs[req_ids[int(sampling[j])]] = [entry]
        if len(verify):
            states = [batch.states[r] for r in sample_rows[verify].tolist()]
            sel = np.concatenate([np.arange(first[j], first[j + 1]) for j in verify.tolist()])
            verify_logits = logits[torch.from_numpy(sel).to(self.device)]
            num_rows = counts[verify].tolist()
            if self.grammar is not None:  # row j of a constrained request: the grammar after its drafts before j
                apply_grammar_bitmask(verify_logits, self.grammar.bitmask, self.grammar.req_id_to_row,
                                      [s.req_id for s in states], num_rows)
            results = rejection_sample(verify_logits, num_rows, [spec[s.req_id] for s in states],
                                       [s.sampling_params for s in states], [s.generator for s in states])
            for j, tokens in zip(verify.tolist(), results, strict=True):
                sampled_token_ids[int(sampling[j])] = tokens
        for j in range(len(sampling)):
            row = int(sample_rows[j])
            for token in sampled_token_ids[int(sampling[j])]:
                batch.append_token(row, token)

    def _propose(self, rows: np.ndarray, sampling: np.ndarray) -> list[list[int]]:
        """Drafts for the next step of every request that sampled now (and whose options the verifier supports),
        aligned with the step's requests; none at all once the batch holds disable_by_batch_size requests."""
        batch = self.input_batch
        proposals: list[list[int]] = [[] for _ in rows]
        limit = self.speculative_config.disable_by_batch_size
        if not len(sampling) or (limit is not None and batch.num_reqs >= limit):
            return proposals
        states, row_list = batch.states, rows.tolist()
        keep = [i for i in sampling.tolist() if states[row_list[i]].can_speculate]  # indices into rows
        if not keep:
            return proposals
        keep_rows = rows[keep]
        drafts = self.proposer.propose(batch.token_ids, keep_rows, batch.num_tokens[keep_rows])
        for i, d in zip(keep, drafts, strict=True):
            proposals[i] = d
        return proposals

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The model's hidden states for this step: one native call for a step of decodes where the model has a
        native decode step (models/llama_native_step.py, bitwise the same) and no row runs a LoRA adapter, else its
        modules. A pipeline stage
        runs its layers on the previous stage's output and hands its own to the next (None but on the last)."""
        if self.pp.size > 1:
            return run_stage(self.model, self.pp, input_ids, positions, self.dtype)
        if self.native_step is not None and get_forward_context().lora_mapping is None:
            hidden_states = self.native_step.forward(input_ids, positions)
            if hidden_states is not None:
                return hidden_states
        return self.model(input_ids, positions)

    # ---- state ----------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            row = batch.req_id_to_row.get(req_id)
            if row is not None and isinstance(self.proposer, SuffixProposer):
                self.proposer.request_finished(batch.output_token_ids(row))
            batch.remove(req_id)
            self.generators.pop(req_id, None)
            self.pooler.drop(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove(req_id)
            self.pooler.drop(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove(new.req_id)  # a resumed request replaces any stale row
            params = new.sampling_params
            generator = self.generators.get(new.req_id)
            if generator is None and params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed % (1 << 63))
                self.generators[new.req_id] = generator
            state = RequestState(new.req_id, params, new.eos_token_id, len(new.prompt_token_ids), generator,
                                 new.lora_request)
            batch.add(state, new.prompt_token_ids + new.output_token_ids, new.block_ids, new.num_computed_tokens)
            if new.pooling_params is not None:
                self.pooler.add(new.req_id, new.pooling_params, len(new.prompt_token_ids))
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                   cached.num_computed_tokens, strict=True):
            row = batch.req_id_to_row[req_id]
            batch.append_blocks(row, block_ids)
            batch.num_computed_tokens[row] = num_computed
        if cached.new_token_ids and not self.pp.is_last:
            self._write_sampled_tokens(cached)

    def _write_sampled_tokens(self, cached: CachedRequestData) -> None:
        """A stage before the last (pipeline parallelism) learns the tokens the last stage sampled from the
        scheduler: each running request's outputs from max(num_computed_tokens, prompt length) on. Rejected drafts
        were never counted in num_tokens, and accepted ones already sit where _write_drafts put them."""
        batch = self.input_batch
        for req_id, num_computed, tokens in zip(cached.req_ids, cached.num_computed_tokens, cached.new_token_ids,
                                                strict=True):
            if tokens:
                row = batch.req_id_to_row[req_id]
                start = max(num_computed, batch.states[row].num_prompt_tokens)
                batch.token_ids[row, start:start + len(tokens)] = tokens
                batch.num_tokens[row] = start + len(tokens)

    # ---- inputs ---------------------------------------------------------------------------------
    def _prepare_inputs(self, rows: np.ndarray, num_sched: np.ndarray):
        """Flatten every scheduled token into one batch.

        Example: two requests, computed [0, 5], scheduled [3, 1] ->
            query_start_loc [0, 3, 4], positions [0, 1, 2, 5], seq_lens [3, 6].
        """
        batch = self.input_batch
        bs = self.block_size
        num_computed = batch.num_computed_tokens[rows]
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        row_of_token = np.repeat(rows, num_sched)  # [T]
        offsets = np.arange(total) - np.repeat(query_start_loc[:-1], num_sched)
        positions = np.repeat(num_computed, num_sched) + offsets  # [T]
        input_ids = batch.token_ids[row_of_token, positions]  # [T]
        slot_mapping = batch.block_table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = num_computed + num_sched
        max_blocks = int(cdiv(seq_lens.max(), bs))
        block_table = batch.block_table[rows, :max_blocks]  # [num_reqs, max_blocks]
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=total,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), metadata

    def _layer_metadata(self, md: AttentionMetadata, rows: np.ndarray) -> list[AttentionMetadata]:
        """Each layer's metadata with several KV cache groups: `md` (group 0's) with group g's block table and slot
        mapping for the layers of group g."""
        batch, bs, dev = self.input_batch, self.block_size, self.device
        qsl = md.query_start_loc_cpu
        num_sched = qsl[1:] - qsl[:-1]
        row_of_token = np.repeat(rows, num_sched)  # [T]
        positions = np.repeat(batch.num_computed_tokens[rows], num_sched) + np.arange(qsl[-1]) - np.repeat(
            qsl[:-1], num_sched)
        max_blocks = md.block_table.shape[1]
        per_group = [md]
        for table in batch.block_tables[1:]:
            slot_mapping = table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
            per_group.append(dataclasses.replace(
                md, block_table=torch.from_numpy(np.ascontiguousarray(table[rows, :max_blocks])).to(dev),
                slot_mapping=torch.from_numpy(slot_mapping).to(dev), plan=None))
        return [per_group[g] for g in self.layer_groups.tolist()]

    # ---- sampling -------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: np.ndarray) -> tuple[list[int], list[LogprobsEntry | None]]:
        batch = self.input_batch
        states = [batch.states[r] for r in rows.tolist()]
        params = [s.sampling_params for s in states]
        if self.grammar is not None:
            apply_grammar_bitmask(logits, self.grammar.bitmask, self.grammar.req_id_to_row,
                                  [s.req_id for s in states])
        needs_tokens = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                           or p.min_tokens for p in params)
        metadata = build_sampling_metadata(
            params,
            [batch.prompt_token_ids(r) for r in rows.tolist()] if needs_tokens else [[] for _ in states],
            [batch.output_token_ids(r) for r in rows.tolist()] if needs_tokens else [[] for _ in states],
            [s.generator for s in states],
            [s.eos_token_id for s in states],
            self.info.vocab_size,
            self.device,
        )
        out = self.sampler(logits, metadata)
        tokens = out.sampled_token_ids.tolist()
        if out.logprobs is None:
            return tokens, [None] * len(tokens)
        return tokens, logprobs_to_entries(out.logprobs, [p.logprobs for p in params])

    def _prompt_logprobs(self, req_ids, rows, num_sched, attn_metadata, hidden_states):
        """Logprobs of each prompt token given the tokens before it, for requests that ask."""
        batch = self.input_batch
        result: dict[str, list[LogprobsEntry | None]] = {}
        for i, row in enumerate(rows.tolist()):
            state = batch.states[row]
            k = state.sampling_params.prompt_logprobs
            start = int(batch.num_computed_tokens[row])
            if k is None or start >= state.num_prompt_tokens:
                continue
            # positions p in this chunk predict prompt token p + 1
            end = min(start + int(num_sched[i]), state.num_prompt_tokens - 1)
            entries: list[LogprobsEntry | None] = [None] if start == 0 else []
            if end > start:
                first = int(attn_metadata.query_start_loc_cpu[i])
                logits = self.model.compute_logits(hidden_states[first:first + end - start])
                targets = torch.from_numpy(batch.token_ids[row, start + 1:end + 1]).to(self.device)
                entries.extend(compute_prompt_logprobs(logits, targets, k))
            result[req_ids[i]] = entries
        return result


def _make_proposer(config, draft_model, device, dtype, max_model_len, block_size, max_prefill_tokens):
    """The draft proposer of the speculative config's method (None: no speculation)."""
    if config is None:
        return None
    if config.method == "draft_model":
        return DraftModelProposer(config, draft_model, device, dtype, max_model_len, block_size,
                                  max_prefill_tokens)
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On CPU the pages come zeroed from the OS (`cpu_allocator.zeroed_pool`) and are faulted
    in by `PoolPrefault` while the engine idles, or by a block's first write; torch.zeros would write every
    byte on the start-up path (seconds for 4 GiB). Zeros matter: the torch attention path multiplies masked
    positions' V by 0, and 0 * NaN garbage would be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(zeroed_pool(int(np.prod(shape)) * itemsize)).view(dtype).view(shape)
