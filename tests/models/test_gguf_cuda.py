"""CUDA: a GGUF model's quantized weights are dequantized at load and multiplied by torch (no CPU kernels); the
results match the CPU's quantized kernels and the greedy SmolLM2 reference. Skipped without a CUDA device;
scripts/gpu_check.sh runs them on a GPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.models.loader import load_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
FIXTURE = Path(__file__).parent.parent / "fixtures" / "smollm2_greedy_fp32.json"


def test_quantized_gguf_on_cuda_dequantizes_and_matches_the_cpu_kernels(tiny_llama_gguf_quantized):
    config = ModelConfig(model=str(tiny_llama_gguf_quantized))
    gpu = load_model(config, torch.device("cuda"), torch.float32)
    qkv = gpu.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_weight is None and qkv.weight.device.type == "cuda" and qkv.weight.dtype == torch.float32
    cpu = load_model(config, torch.device("cpu"), torch.float32)
    ids = [1, 5, 9, 44, 100, 383, 7, 7, 12, 300, 2, 64, 65]
    with torch.inference_mode():
        ours = PagedRunner(gpu).step([("a", ids)]).cpu()
        ref = PagedRunner(cpu).step([("a", ids)])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_gguf_greedy_on_cuda_matches_reference():
    reference = json.loads(FIXTURE.read_text())
    llm = LLM(device="cuda", dtype="float32", max_model_len=1024)
    cases = reference["cases"]
    outs = llm.generate([c["prompt_ids"] for c in cases], SamplingParams(temperature=0.0, max_tokens=32),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [c["output_ids"] for c in cases]
