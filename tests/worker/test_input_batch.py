"""InputBatch (the runner's persistent batch) against a model-free reference: after any sequence of adds, token
appends, block appends and removes, every row holds its request's tokens and blocks and rows stay packed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, RequestState

MAX_REQS, MAX_LEN, BLOCK = 4, 32, 4


def _state(req_id: str, num_prompt: int) -> RequestState:
    return RequestState(req_id, SamplingParams(), None, num_prompt, None)


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.integers(0, 1000)),
    st.tuples(st.just("token"), st.integers(0, 7), st.integers(0, 1000)),
    st.tuples(st.just("block"), st.integers(0, 7), st.integers(0, 1000)),
    st.tuples(st.just("remove"), st.integers(0, 7), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=40))
def test_rows_match_the_reference(ops):
    batch = InputBatch(MAX_REQS, MAX_LEN, BLOCK)
    reference: dict[str, tuple[list[int], list[int], int]] = {}  # req_id -> (tokens, blocks, num_prompt)
    next_id = 0
    for kind, a, b in ops:
        ids = sorted(reference)
        if kind == "add" and len(reference) < MAX_REQS:
            req_id, tokens = f"r{next_id}", [b + i for i in range(a)]
            next_id += 1
            blocks = [b % 50 + i for i in range(-(-a // BLOCK))]
            batch.add(_state(req_id, a), tokens, blocks, num_computed_tokens=0)
            reference[req_id] = (tokens, blocks, a)
        elif kind == "token" and ids:
            req_id = ids[a % len(ids)]
            tokens, blocks, _ = reference[req_id]
            if len(tokens) < MAX_LEN and len(tokens) < len(blocks) * BLOCK:
                batch.append_token(batch.req_id_to_row[req_id], b)
                tokens.append(b)
        elif kind == "block" and ids:
            req_id = ids[a % len(ids)]
            blocks = reference[req_id][1]
            if len(blocks) < MAX_LEN // BLOCK:
                batch.append_blocks(batch.req_id_to_row[req_id], [b])
                blocks.append(b)
        elif kind == "remove" and ids:
            req_id = ids[a % len(ids)]
            batch.remove(req_id)
            del reference[req_id]
        _check(batch, reference)
    batch.remove("not-there")  # unknown ids are ignored
    _check(batch, reference)


def _check(batch: InputBatch, reference) -> None:
    assert batch.num_reqs == len(reference)
    assert sorted(batch.req_id_to_row.values()) == list(range(batch.num_reqs))  # packed rows
    for req_id, (tokens, blocks, num_prompt) in reference.items():
        row = batch.req_id_to_row[req_id]
        assert batch.states[row].req_id == req_id
        assert batch.prompt_token_ids(row) + batch.output_token_ids(row) == tokens
        assert batch.prompt_token_ids(row) == tokens[:num_prompt]
        assert batch.block_table[row, :batch.num_blocks[row]].tolist() == blocks
