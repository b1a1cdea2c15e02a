"""The 8-bit-activation fast mode (activation_quantization="int8") on the real SmolLM2 GGUF: the linears and the
tied LM head run the int8 kernel, outputs stay close to the lossless mode, a request's logits do not depend on
its batch; and the mode is refused where it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner

from pagedllm.config import ModelConfig
from pagedllm.kernels import quant_q8act
from pagedllm.layers.int8_activation_weight import Int8ActivationWeight
from pagedllm.layers.linear import Linear
from pagedllm.models.loader import load_model

CPU = torch.device("cpu")
FIXTURE = Path(__file__).parent.parent / "fixtures" / "smollm2_greedy_fp32.json"
needs_kernel = pytest.mark.skipif(not quant_q8act.available(), reason="needs the AVX2 native kernels")


def test_unknown_value_is_refused():
    with pytest.raises(ValueError, match="--activation-quantization must be none or int8"):
        ModelConfig(activation_quantization="int4")


@needs_kernel
def test_int8_needs_a_gguf_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="needs a GGUF model"):
        load_model(ModelConfig(model=str(tiny_llama_dir), activation_quantization="int8"), CPU, torch.float32)


@needs_kernel
def test_int8_needs_float32(tiny_llama_gguf):
    with pytest.raises(ValueError, match="needs a GGUF model run quantized"):
        load_model(ModelConfig(model=str(tiny_llama_gguf), activation_quantization="int8"), CPU, torch.bfloat16)


@pytest.fixture(scope="module")
def smollm2_pair():
    lossless = load_model(ModelConfig(), CPU, torch.float32)
    fast = load_model(ModelConfig(activation_quantization="int8"), CPU, torch.float32)
    return lossless, fast


def _prompt_logprobs(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    logits = PagedRunner(model).step([(str(i), p) for i, p in enumerate(prompts)])
    out, start = [], 0
    for p in prompts:
        out.append(torch.log_softmax(logits[start:start + len(p)].double(), dim=-1))
        start += len(p)
    return out


@pytest.mark.slow
@needs_kernel
def test_smollm2_int8_runs_the_int8_kernel_close_to_lossless(smollm2_pair):
    lossless, fast = smollm2_pair
    linears = [m for m in fast.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.quant_weight, Int8ActivationWeight) for m in linears)
    assert fast.lm_head.quant_weight is fast.model.embed_tokens.quant_weight  # one Q8_0 table, not two
    cases = json.loads(FIXTURE.read_text())["cases"]
    texts = [c["prompt_ids"] + c["output_ids_ignore_eos"] for c in cases]
    ref, got = _prompt_logprobs(lossless, texts), _prompt_logprobs(fast, texts)
    deltas, agree, total = [], 0, 0
    for ids, r, g in zip(texts, ref, got, strict=True):
        nxt = torch.tensor(ids[1:])
        deltas.append((r[:-1].gather(1, nxt[:, None]) - g[:-1].gather(1, nxt[:, None])).abs())
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += len(ids)
    mean_delta = float(torch.cat(deltas).mean())
    # measured: ~0.03 nats per token, ~97% top-1 agreement; the lossless mode differs from itself by 0
    assert 0 < mean_delta < 0.1 and agree / total > 0.9, (mean_delta, agree / total)


@pytest.mark.slow
@needs_kernel
def test_smollm2_int8_rows_independent_of_the_batch(smollm2_pair):
    _, fast = smollm2_pair
    cases = json.loads(FIXTURE.read_text())["cases"]
    prompts = [c["prompt_ids"] for c in cases]
    alone = PagedRunner(fast).step([("a", prompts[0])])
    batched = PagedRunner(fast, seed=1).step([("b", prompts[1]), ("a", prompts[0]), ("c", prompts[2])])
    start = len(prompts[1])
    assert torch.equal(batched[start:start + len(prompts[0])], alone)
