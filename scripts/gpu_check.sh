#!/usr/bin/env bash
# Short CUDA check of the engine, for a machine with an NVIDIA GPU (a few minutes):
#  1. torch sees the GPU;
#  2. the CUDA tests (pytest -m cuda): the GGUF model on --device cuda, its quantized weights dequantized at load,
#     matches the CPU's quantized kernels (tiny model) and the greedy SmolLM2 fp32 reference (tests/fixtures);
#  3. one real greedy request through the offline API on cuda, printed.
# Usage: scripts/gpu_check.sh   (PYTHON=... to choose the interpreter; default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible to torch"; print("GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
"$PY" -m pytest -q -m cuda -p no:cacheprovider tests/models/test_gguf_cuda.py
"$PY" - <<'PY'
from pagedllm import LLM, SamplingParams

llm = LLM(device="cuda", dtype="float32", max_model_len=512)
(out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
print("cuda greedy:", repr(out.outputs[0].text))
PY
echo "gpu_check: OK"
