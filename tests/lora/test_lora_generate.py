"""Multi-LoRA offline: PEFT adapters with random non-zero weights on the tiny random Llama are token-identical to
transformers with PEFT's merged model (merge_and_unload) in fp32, with the base model and several adapters mixed in
one generate call (one step holds rows of every adapter, grouped by adapter), with --max-loras below the number of
adapters, with prefix caching (repeated prompts hit only their own adapter's blocks), over a GGUF base, and adapters
that cannot be served are refused with a message that says why."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from lora_adapters import NUM_TOKENS
from pagedllm import SamplingParams
from pagedllm.engine.input_processor import InvalidRequestError
from pagedllm.lora.peft import LoRAAdapterError, LoRAAdapterNotFoundError
from pagedllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
IDS = {"sql": 1, "chat": 2, "rs": 3}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _lora(tiny_adapters, name):
    return None if name is None else LoRARequest(name, IDS[name], tiny_adapters[name])


def test_mixed_batch_matches_peft_merged_with_prefix_caching(make_llm, tiny_llama_dir, tiny_adapters, expected):
    """Base, three adapters and one adapter several times in one call; then the same prompts again (prefix-cache
    hits, each on its own adapter's blocks), shuffled. max_loras=2: the scheduler runs at most two adapters a step
    (with the base model's rows), the third waits; a step's rows of one adapter are apart (an index, not a slice)."""
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=8, block_size=4)
    prompts = _prompts(6, seed=0)
    prompts[5] = prompts[1]  # the same prompt under `sql` and `chat`: no shared blocks
    prompts[3] = prompts[0]  # ... and under the base model and `sql`
    names = [None, "sql", "chat", "sql", "rs", "chat"]
    for attempt in range(2):
        order = list(range(len(prompts))) if attempt == 0 else random.Random(1).sample(range(len(prompts)), 6)
        outs = llm.generate([prompts[i] for i in order], GREEDY, use_tqdm=False,
                            lora_request=[_lora(tiny_adapters, names[i]) for i in order])
        for i, out in zip(order, outs, strict=True):
            assert list(out.outputs[0].token_ids) == expected(names[i], prompts[i]), (attempt, names[i])
            if attempt == 1:  # every prompt ran before under the same adapter: its full blocks are cached
                assert out.num_cached_tokens == (len(prompts[i]) - 1) // 4 * 4
    assert expected("sql", prompts[1]) != expected(None, prompts[1])  # the adapters do change the outputs
    assert expected("chat", prompts[1]) != expected("sql", prompts[1])


def test_gguf_base_runs_the_adapter_in_place(make_llm, tiny_llama_gguf, tiny_llama_gguf_quantized, tiny_adapters,
                                             expected):
    """The deltas add to the quantized kernels' output: an F32 GGUF of the same weights gives transformers' tokens;
    a quantized one runs the adapter (its outputs differ from its base's)."""
    prompts = _prompts(3, seed=5)
    lora = _lora(tiny_adapters, "sql")
    llm = make_llm(tiny_llama_gguf, enable_lora=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected("sql", p) for p in prompts]
    quantized = make_llm(tiny_llama_gguf_quantized, enable_lora=True)
    with_adapter = quantized.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    base = quantized.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in with_adapter] != [o.outputs[0].token_ids for o in base]


def _edited(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


def test_adapters_that_cannot_be_served_are_refused(make_llm, tiny_llama_dir, tiny_adapters, tmp_path):
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_lora_rank=8)
    prompt = _prompts(1, seed=9)

    def refused(path, match, error=LoRAAdapterError):
        with pytest.raises(error, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, path))
    refused(str(tmp_path / "missing"), "No adapter found for", LoRAAdapterNotFoundError)
    refused(_edited(tiny_adapters["sql"], tmp_path / "dora", use_dora=True), "DoRA")
    refused(_edited(tiny_adapters["sql"], tmp_path / "save", modules_to_save=["lm_head"]), "modules_to_save")
    refused(_edited(tiny_adapters["sql"], tmp_path / "emb", target_modules=["embed_tokens"]), "embeddings")
    refused(tiny_adapters["rs"], "LoRA rank 16 is greater than max_lora_rank 8")
    bad_shape = _edited(tiny_adapters["sql"], tmp_path / "rank", r=4)  # config says 4, tensors say 8
    refused(bad_shape, "this model needs \\[4, .*\\(rank 4\\)")
    assert not llm.llm_engine.has_unfinished_requests()
    base = make_llm(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        base.generate(prompt, GREEDY, use_tqdm=False, lora_request=_lora(tiny_adapters, "sql"))


def test_one_adapter_a_step_evicts_and_reloads_with_chunked_prefill(make_llm, tiny_llama_dir, tiny_adapters,
                                                                    expected):
    """--max-loras 1 and --max-cpu-loras 1: the adapters take turns (one a step, the other evicted and reloaded from
    its folder), prompts prefilled in chunks of at most 16 tokens; outputs unchanged."""
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=1, max_num_batched_tokens=16)
    prompts = _prompts(3, seed=11)
    names = ["sql", "chat", "sql"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[_lora(tiny_adapters, n) for n in names])
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected(n, p) for n, p in zip(names, prompts, strict=True)]
    manager = llm.llm_engine.engine_core.runner.lora_manager
    assert len(manager.loaded) == 1
