"""The persistent batch: per-request state the ModelRunner keeps across steps.

Rows are packed in [0, num_reqs). The scheduler's diffs update rows in place; a removed row is filled by
moving the last row into it, so per-step inputs are built with numpy over contiguous rows and no
per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.layers.sampling.rejection_sampler import can_speculate
from pagedllm.math_utils import cdiv
from pagedllm.messages import LoRARequest
from pagedllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner knows of one request (its tokens live in InputBatch.token_ids)."""

    req_id: str
    sampling_params: SamplingParams
    eos_token_id: int | None
    num_prompt_tokens: int
    generator: torch.Generator | None
    lora_request: LoRARequest | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    can_speculate: bool = field(init=False)
    """Whether the verifier keeps this request's distribution exactly (rejection_sampler.can_speculate), fixed by
    its sampling params: computed once here, not on every step's proposal."""

    def __post_init__(self) -> None:
        self.can_speculate = can_speculate(self.sampling_params)


class InputBatch:
    """num_kv_cache_groups: block tables per request (core/kv_cache_spec.py); with more than one, `block_tables[g]`
    is group g's table (`block_table` is group 0's) and block ids arrive as one list, group after group, in equal
    parts (the groups' tables grow together)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_kv_cache_groups: int = 1):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = cdiv(max_model_len, block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_kv_cache_groups = num_kv_cache_groups
        self.block_tables = np.zeros((num_kv_cache_groups, max_num_reqs, max_blocks), dtype=np.int32)
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # every group's table has this length
        self.states: list[RequestState] = []  # row -> state
        self.req_id_to_row: dict[str, int] = {}
        # Bumped whenever rows are added, removed or moved, so per-batch caches know to rebuild.
        self.version = 0

    @property
    def num_reqs(self) -> int:
        return len(self.states)

    def add(self, state: RequestState, token_ids: list[int], block_ids: list[int],
            num_computed_tokens: int) -> None:
        if self.num_reqs >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        row = self.num_reqs
        self.states.append(state)
        self.req_id_to_row[state.req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.version += 1

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Append to the row's table(s): with several KV cache groups, `block_ids` is each group's new ids in turn."""
        if block_ids:
            start = self.num_blocks[row]
            if self.num_kv_cache_groups == 1:
                self.block_table[row, start:start + len(block_ids)] = block_ids
                self.num_blocks[row] = start + len(block_ids)
                return
            n = len(block_ids) // self.num_kv_cache_groups
            self.block_tables[:, row, start:start + n] = np.asarray(block_ids).reshape(self.num_kv_cache_groups, n)
            self.num_blocks[row] = start + n

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        if row != last:  # move the last row into the hole
            moved = self.states[last]
            self.states[row] = moved
            self.req_id_to_row[moved.req_id] = row
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            nb = self.num_blocks[last]
            self.block_tables[:, row, :nb] = self.block_tables[:, last, :nb]
            for arr in (self.num_tokens, self.num_computed_tokens, self.num_blocks):
                arr[row] = arr[last]
        self.states.pop()
        self.version += 1

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.states[row].num_prompt_tokens:self.num_tokens[row]].tolist()

    def prompt_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, :self.states[row].num_prompt_tokens].tolist()
