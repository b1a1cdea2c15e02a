"""Our paged Llama against transformers' LlamaForCausalLM on the tiny random model (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.layers import attention, linear
from pagedllm.models.loader import load_model

ATOL = 1e-4


@pytest.fixture(autouse=True, params=["native", "torch"])
def attention_paths(request, monkeypatch):
    """Every test runs twice: the CPU fp32 default (native decode attention and elementwise kernels,
    grouped-matmul prefill, oneDNN linears) and the portable paths (decode: gather + SDPA; prefill: SDPA;
    torch ops; F.linear), as on CUDA, in bf16 or for long chunks."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda dtype, device: False)
        monkeypatch.setattr(attention, "GROUPED_SCORES_MAX_BYTES", 0)
        monkeypatch.setattr(linear, "onednn_available", lambda weight: False)
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture
def model(tiny_llama_dir, attention_paths):  # loaded per path: the linears are packed (or not) at load
    return load_model(ModelConfig(model=str(tiny_llama_dir)), torch.device("cpu"), torch.float32)


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_whole_prefill_matches_transformers(model, reference):
    ids = prompt(45, seed=1)
    out = PagedRunner(model).step([("a", ids)])
    assert (out - reference_logits(reference, ids)).abs().max().item() < ATOL


@pytest.mark.parametrize("block_size", [16, 4])
def test_chunked_prefill_through_paged_cache(model, reference, block_size):
    ids = prompt(45, seed=2)
    runner = PagedRunner(model, block_size=block_size)
    out = torch.cat([runner.step([("a", ids[i : i + 7])]) for i in range(0, len(ids), 7)])
    assert (out - reference_logits(reference, ids)).abs().max().item() < ATOL


def test_sixteen_decode_steps(model, reference):
    ids = prompt(20, seed=3)
    runner = PagedRunner(model)
    logits = [runner.step([("a", ids)])[-1]]
    for _ in range(16):  # greedy continuation, one token per step
        ids.append(int(logits[-1].argmax()))
        logits.append(runner.step([("a", ids[-1:])])[-1])
    ref = reference_logits(reference, ids)  # position i predicts token i + 1
    assert (torch.stack(logits) - ref[19:]).abs().max().item() < ATOL


@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_batch_of_prefills_and_decodes(model, reference, block_size):
    prompts = {"a": prompt(23, 4), "b": prompt(5, 5), "c": prompt(40, 6), "d": prompt(1, 7)}
    full = {r: list(p) for r, p in prompts.items()}
    # Each step: (req_id, number of new tokens); a request is decoding once its prompt is done.
    schedule = [
        [("a", 23), ("b", 3)],
        [("a", 1), ("b", 2), ("c", 17)],
        [("c", 23), ("a", 1), ("d", 1), ("b", 1)],
        [("b", 1), ("a", 1), ("c", 1), ("d", 1)],
        [("d", 1), ("c", 1)],
    ]
    runner = PagedRunner(model, block_size=block_size)
    done = {r: 0 for r in prompts}
    got: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}
    for step in schedule:
        chunks = []
        for req_id, n in step:
            seq = full[req_id]
            if done[req_id] + n > len(seq):  # decoding: append a made-up next token
                seq.append(prompt(1, 100 + len(seq))[0])
            chunks.append((req_id, seq[done[req_id] : done[req_id] + n]))
            done[req_id] += n
        logits = runner.step(chunks)
        offset = 0
        for req_id, tokens in chunks:
            got[req_id].append(logits[offset : offset + len(tokens)])
            offset += len(tokens)
    for req_id, seq in full.items():
        ref = reference_logits(reference, seq[: done[req_id]])
        assert (torch.cat(got[req_id]) - ref).abs().max().item() < ATOL, req_id


def test_padded_rows_past_num_actual_tokens(model, reference):
    from pagedllm.layers.forward_context import get_forward_context

    ids = prompt(9, seed=8)
    runner = PagedRunner(model)
    # Run once normally to fill in request "a"'s metadata, then repeat with two padding rows.
    wrapped = model.forward

    def padded_forward(input_ids, positions):
        md = get_forward_context().attn_metadata
        md.slot_mapping = torch.cat([md.slot_mapping, md.slot_mapping.new_tensor([0, 0])])
        hidden = wrapped(torch.cat([input_ids, input_ids.new_zeros(2)]), torch.cat([positions, positions[:2]]))
        return hidden[: md.num_actual_tokens]

    model.forward = padded_forward
    try:
        out = runner.step([("a", ids)])
    finally:
        del model.forward
    assert (out - reference_logits(reference, ids)).abs().max().item() < ATOL


def test_hf_folder_and_gguf_give_the_same_logits(model, tiny_llama_gguf):
    gguf_model = load_model(ModelConfig(model=str(tiny_llama_gguf)), torch.device("cpu"), torch.float32)
    ids = prompt(30, seed=9)
    a = PagedRunner(model).step([("a", ids)])
    b = PagedRunner(gguf_model).step([("a", ids)])
    assert (a - b).abs().max().item() < 1e-5


def test_compute_logits_is_float32(tiny_llama_dir):
    m = load_model(ModelConfig(model=str(tiny_llama_dir)), torch.device("cpu"), torch.bfloat16)
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    out = PagedRunner(m).step([("a", prompt(5, seed=10))])
    assert out.dtype == torch.float32 and out.shape == (5, m.info.vocab_size)
