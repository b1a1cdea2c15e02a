"""The native decode step (models/llama_native_step.py) against the module path on the tiny Llama in each
precision mode it runs: decode logits and the KV cache bitwise equal at batch 1, 3 and 8 and with 1 and 2 threads;
prefill and mixed steps left to the modules; built only where it applies; and the engine's runner uses it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_runner import PagedRunner

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels, quant_q8act
from pagedllm.layers.forward_context import get_forward_context
from pagedllm.models import llama_native_step
from pagedllm.models.llama_native_step import LlamaNativeDecodeStep
from pagedllm.models.loader import load_model
from pagedllm.worker.kv_scales import calculate_kv_scales

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.float32, torch.device("cpu")),
                                reason="native CPU kernels unavailable")

CPU = torch.device("cpu")

MODES = {  # name: (model fixture, ModelConfig options)
    "gguf": ("tiny_llama_gguf_quantized", {}),
    "gguf-int8-activations": ("tiny_llama_gguf_quantized", {"activation_quantization": "int8"}),
    "fp8-weights": ("tiny_llama_dir", {"quantization": "fp8"}),
}


def _load(request, mode: str):
    fixture, options = MODES[mode]
    if options.get("activation_quantization") and not quant_q8act.available():
        pytest.skip("needs the AVX2 int8 kernel")
    return load_model(ModelConfig(model=str(request.getfixturevalue(fixture)), **options), CPU, torch.float32)


def _cache_bytes(runner: PagedRunner) -> list[torch.Tensor]:
    return [kv.view(torch.uint8) for kv in runner.kv_caches]


def _compare(model, step, batch: int, kv_dtype: torch.dtype | None = None) -> None:
    """Prefill `batch` prompts, a mixed step, then decode steps: logits and caches of the native step's runner
    equal the module path's bit for bit, and the native step ran exactly the all-decode steps."""
    ref, nat = PagedRunner(model, kv_dtype=kv_dtype), PagedRunner(model, native_step=step, kv_dtype=kv_dtype)
    rng = np.random.default_rng(batch)
    lengths = [14, 15, 16, 2, 31, 9, 17, 5][:batch]  # 4 decodes take some of them across a block boundary
    prompts = {str(i): rng.integers(0, model.info.vocab_size, n).tolist() for i, n in enumerate(lengths)}
    chunks = list(prompts.items())  # step 0: the prompts
    for i in range(6):
        want, got = ref.step(chunks), nat.step(chunks)
        assert torch.equal(got, want), f"step {i}: max |diff| {(got - want).abs().max()}"
        ends = np.cumsum([len(tokens) for _, tokens in chunks]) - 1
        greedy = want[torch.from_numpy(ends[:batch])].argmax(-1).tolist()
        chunks = [(r, [t]) for r, t in zip(prompts, greedy, strict=True)]
        if i == 1:  # step 2 mixes a new request's prompt with the decodes: the modules run it
            chunks.append(("new", [3, 4, 5]))
    assert nat.native_steps == 4  # steps 1, 3, 4, 5
    for layer, (a, b) in enumerate(zip(_cache_bytes(nat), _cache_bytes(ref), strict=True)):
        assert torch.equal(a, b), f"layer {layer}'s KV cache differs"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_decode_steps_are_bitwise_the_module_path(request, mode, threads):
    model = _load(request, mode)
    step = LlamaNativeDecodeStep.build(model)
    assert step is not None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch in (1, 3, 8):
            _compare(model, step, batch)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_narrow_kv_cache_is_bitwise_the_module_path(tiny_llama_gguf_quantized, kv_dtype):
    model = load_model(ModelConfig(model=str(tiny_llama_gguf_quantized)), CPU, torch.float32)
    _compare(model, LlamaNativeDecodeStep.build(model), 3, kv_dtype)


def test_calibrated_fp8_kv_scales_are_bitwise_the_module_path(tiny_llama_gguf_quantized):
    """--calculate-kv-scales sets each layer's k_scale, v_scale and K rounding after the runner (and its native
    step) is built: the native step must pick them up."""
    model = load_model(ModelConfig(model=str(tiny_llama_gguf_quantized)), CPU, torch.float32)
    step = LlamaNativeDecodeStep.build(model)
    calculate_kv_scales(model, list(range(3, 90)), CPU, torch.float32)
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert any(a.k_scale != 1.0 or a.v_scale != 1.0 for a in attns) and all(a.k_comp is not None for a in attns)
    _compare(model, step, 3, torch.float8_e4m3fn)


def test_biases_are_added_as_the_linears_add_them(tiny_llama_gguf_quantized):
    model = load_model(ModelConfig(model=str(tiny_llama_gguf_quantized)), CPU, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for layer in model.model.layers:  # Qwen2-style qkv biases, and the others too
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.bias = torch.nn.Parameter(torch.randn(linear.out_features, generator=gen) * 0.1,
                                             requires_grad=False)
    _compare(model, LlamaNativeDecodeStep.build(model), 3)


def test_built_only_where_it_applies(tiny_llama_gguf_quantized, tiny_llama_dir, monkeypatch):
    quantized = load_model(ModelConfig(model=str(tiny_llama_gguf_quantized)), CPU, torch.float32)
    assert LlamaNativeDecodeStep.build(quantized) is not None
    float_weights = load_model(ModelConfig(model=str(tiny_llama_dir)), CPU, torch.float32)  # oneDNN linears
    assert LlamaNativeDecodeStep.build(float_weights) is None
    monkeypatch.setenv(llama_native_step.SWITCH_ENV, "0")
    assert LlamaNativeDecodeStep.build(quantized) is None


def test_the_engine_runs_decode_steps_natively(tiny_llama_gguf_quantized, monkeypatch):
    """The runner takes the native step for its decode steps, with the tokens of the module path (switched off)."""
    prompts, params = [[5, 6, 7], [9, 10, 11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def llm():
        return LLM(str(tiny_llama_gguf_quantized), dtype="float32", max_model_len=128, num_gpu_blocks_override=64)

    native = llm()
    step = native.llm_engine.engine_core.runner.native_step
    assert step is not None
    ran, forward = [], step.forward

    def counted(*args):
        hidden = forward(*args)
        ran.append(hidden is not None)
        return hidden

    step.forward = counted
    tokens = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    assert sum(ran) == 7  # every step after the prompts' decodes both requests
    monkeypatch.setenv(llama_native_step.SWITCH_ENV, "0")
    plain = llm()
    assert plain.llm_engine.engine_core.runner.native_step is None
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == tokens


def test_verify_steps_of_speculative_decoding_run_natively(tiny_llama_gguf_quantized, monkeypatch):
    """Steps that verify drafts (several rows per request, each attending to the rows before it) take the native
    step too, with the tokens of plain decoding: greedy output with speculation stays bit-identical."""
    motif = [11, 12, 13, 14, 15]
    prompts = [motif * 6, [7, 8, 9] * 5 + [3], [21, 22, 23, 24]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def llm(**kwargs):
        return LLM(str(tiny_llama_gguf_quantized), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
                   **kwargs)

    spec = llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3})
    step = spec.llm_engine.engine_core.runner.native_step
    verify_steps, forward = [], step.forward

    def counted(*args):
        hidden = forward(*args)
        verify_reqs = get_forward_context().attn_metadata.verify_reqs
        if verify_reqs is not None and len(verify_reqs):
            verify_steps.append(hidden is not None)
        return hidden

    step.forward = counted
    tokens = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert verify_steps and all(verify_steps)  # every verify step ran natively
    assert spec.llm_engine.engine_core.scheduler.spec_decoding_totals.num_accepted_tokens > 0
    plain = llm()
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == tokens
    monkeypatch.setenv(llama_native_step.SWITCH_ENV, "0")
    modules = llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3})
    assert [o.outputs[0].token_ids for o in modules.generate(prompts, params, use_tqdm=False)] == tokens
