#!/usr/bin/env bash
# Speculative decoding in one sitting (issue 15): pagedllm served with speculation off / ngram / suffix and vLLM's
# CPU build with the same --speculative-config, at concurrency 1 and 16, on the copy-heavy set and on random
# prompts, one server at a time, every engine measured by `pagedllm bench serve`; one table at the end.
#
#   benchmarks/spec_decode_sitting.sh                          # the sitting: RUNS=2, ~1.5 h with vLLM's cold starts
#   QUICK=1 ENGINES="pagedllm-off pagedllm-suffix" benchmarks/spec_decode_sitting.sh   # smoke test, minutes
#   STEPS=report OUT=... benchmarks/spec_decode_sitting.sh     # only the table, from OUT's results
#
# Engines (ENGINES, default: all six): pagedllm-off, pagedllm-ngram, pagedllm-suffix (port PAGEDLLM_PORT, 8001),
# vllm-off, vllm-ngram, vllm-suffix (`peers.sh serve-vllm`, port 8000). vLLM's suffix method imports
# arctic_inference.suffix_decoding: without that package in the peers' venv that server fails to start and the
# table says so. Its sdist builds only that module's C++ extension; install it without touching the venv's
# torch/vllm/protobuf (PyPI: arctic_inference-0.3.0.tar.gz, unpacked in DIR):
#   $VENV/bin/pip install --no-deps nanobind==2.9.2      # the venv already has setuptools, ninja; cmake >= 3.18
#   PATH=$VENV/bin:$PATH VIRTUAL_ENV=$VENV CMAKE_BUILD_PARALLEL_LEVEL=1 \
#     nice -n 10 $VENV/bin/pip install --no-deps --no-build-isolation DIR   # ~1 min
# The package also registers a vLLM general plugin; it patches vLLM only when ARCTIC_INFERENCE_ENABLED=1 (and
# then refuses to start off CUDA), so the vLLM engines run with it set to 0: vLLM 0.32 unpatched.
# Configs: NGRAM_CONFIG and SUFFIX_CONFIG (JSON, the same for both engines unless VLLM_NGRAM_CONFIG /
# VLLM_SUFFIX_CONFIG say otherwise: vLLM 0.32 refuses `disable_by_batch_size`, a key of older vLLMs). Workloads (WORKLOADS, "DATASET:C:N"):
# copy-heavy and random (INPUT_LEN-token prompts), OUTPUT_LEN tokens with ignore_eos (IGNORE_EOS), concurrency C, N prompts,
# seed per workload and run (every engine gets the same prompts). Per run the engines' order rotates.
# For every measurement the server's /metrics is read before and after: the draft, accepted-token and draft
# counters give the acceptance rate and mean acceptance length (vLLM's and pagedllm's names are the same).
# IGNORE_EOS (1): 0 lets each request end at its end-of-sequence token (vllm bench serve's default), as a copy does
# when it is done; at temperature 0 every engine then generates the same tokens, so tok/s still compare.
# TEMPERATURE: sent with every request (unset: none, so each server samples at its default, 1.0 for both);
# 0 is greedy, where a copy-heavy output follows its prompt and the drafts are accepted.
# Environment: RUNS (2), QUICK (0), STEPS (serve,report), OUT (/tmp/pagedllm-spec-sitting), PY and PAGEDLLM
# (.venv's), PAGEDLLM_ARGS (--dtype auto), PAGEDLLM_PORT, PEERS_SH, PEERS_DIR, VLLM_DTYPE, TOKENIZER (peers.sh
# model-dir: the bf16 SmolLM2 folder, the same weights pagedllm embeds).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PEERS=${PEERS_SH:-$ROOT/../shared/bench/peers.sh}  # from a worktree: PEERS_SH=/work/shared/bench/peers.sh
export PEERS_DIR=${PEERS_DIR:-/tmp/pagedllm-peers}
PY=${PY:-$ROOT/.venv/bin/python}
PAGEDLLM=${PAGEDLLM:-$ROOT/.venv/bin/pagedllm}
RUNS=${RUNS:-2}
QUICK=${QUICK:-0}
STEPS=${STEPS:-serve,report}
PORT=${PAGEDLLM_PORT:-8001}
ENGINES=${ENGINES:-"pagedllm-off pagedllm-ngram pagedllm-suffix vllm-off vllm-ngram vllm-suffix"}
NGRAM_CONFIG=${NGRAM_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'}
SUFFIX_CONFIG=${SUFFIX_CONFIG:-'{"method": "suffix", "num_speculative_tokens": 4}'}
read -r -a PAGEDLLM_ARGS <<<"${PAGEDLLM_ARGS:---dtype auto}"
if [ "$QUICK" = 1 ]; then
  WORKLOADS=${WORKLOADS:-"copy-heavy:1:2 random:2:2"}; OUTPUT_LEN=${OUTPUT_LEN:-16}; INPUT_LEN=${INPUT_LEN:-64}
else
  WORKLOADS=${WORKLOADS:-"copy-heavy:1:8 copy-heavy:16:32 random:1:8 random:16:32"}
  OUTPUT_LEN=${OUTPUT_LEN:-128}; INPUT_LEN=${INPUT_LEN:-256}
fi
OUT=${OUT:-/tmp/pagedllm-spec-sitting}
mkdir -p "$OUT/logs"
if grep -qwE 'amx_bf16|avx512_bf16' /proc/cpuinfo; then VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}; else VLLM_DTYPE=${VLLM_DTYPE:-float32}; fi

config_of() {  # ENGINE -> the speculative config JSON ("" for off)
  case $1 in
    vllm-ngram) echo "${VLLM_NGRAM_CONFIG:-$NGRAM_CONFIG}" ;; vllm-suffix) echo "${VLLM_SUFFIX_CONFIG:-$SUFFIX_CONFIG}" ;;
    *-ngram) echo "$NGRAM_CONFIG" ;; *-suffix) echo "$SUFFIX_CONFIG" ;; *) echo "" ;;
  esac
}

PD_PID=""
start_engine() {  # ENGINE -> URL on stdout's last line, or return 1
  local engine=$1 config; config=$(config_of "$1")
  local spec=(); [ -n "$config" ] && spec=(--speculative-config "$config")
  case $engine in
    pagedllm-*)
      "$PAGEDLLM" serve --host 127.0.0.1 --port "$PORT" --served-model-name smollm2 --max-model-len 2048 \
        "${PAGEDLLM_ARGS[@]}" "${spec[@]}" >"$OUT/logs/$engine.log" 2>&1 &
      PD_PID=$!
      for _ in $(seq 1200); do
        curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && { URL=http://127.0.0.1:$PORT; return 0; }
        kill -0 "$PD_PID" 2>/dev/null || { echo "$engine exited; see $OUT/logs/$engine.log" >&2; PD_PID=""; return 1; }
        sleep 0.5
      done
      return 1 ;;
    vllm-*)
      DTYPE=$VLLM_DTYPE ARCTIC_INFERENCE_ENABLED=0 "$PEERS" serve-vllm "${spec[@]}" >"$OUT/logs/$engine.log" 2>&1 || return 1
      URL=http://127.0.0.1:8000 ;;
  esac
}
stop_engine() {
  case $1 in
    pagedllm-*)
      [ -n "$PD_PID" ] || return 0
      kill -TERM "$PD_PID" 2>/dev/null
      for _ in $(seq 100); do kill -0 "$PD_PID" 2>/dev/null || break; sleep 0.3; done
      kill -0 "$PD_PID" 2>/dev/null && kill -KILL "$PD_PID" 2>/dev/null
      wait "$PD_PID" 2>/dev/null
      PD_PID="" ;;
    vllm-*) "$PEERS" stop >/dev/null 2>&1 ;;
  esac
}

measure() {  # ENGINE RUN URL
  local engine=$1 run=$2 url=$3 w dataset c n f seed i=0 sampling=()
  [ -n "${TEMPERATURE:-}" ] && sampling=(--temperature "$TEMPERATURE")
  [ "${IGNORE_EOS:-1}" = 1 ] && sampling+=(--ignore-eos)
  for w in $WORKLOADS; do
    IFS=: read -r dataset c n <<<"$w"
    i=$((i + 1)); seed=$((i * 100 + run))
    f="$engine-$dataset-c$c-run$run"
    curl -s "$url/metrics" >"$OUT/$f.metrics-before"
    "$PAGEDLLM" bench serve --backend openai --base-url "$url" --endpoint /v1/completions --model smollm2 \
      --tokenizer "$TOKENIZER" --dataset-name "$dataset" --random-input-len "$INPUT_LEN" \
      --random-output-len "$OUTPUT_LEN" --copy-heavy-output-len "$OUTPUT_LEN" --seed "$seed" "${sampling[@]}" \
      --num-prompts "$n" --max-concurrency "$c" --disable-tqdm --label "$engine" --save-result \
      --result-dir "$OUT" --result-filename "$f.json" >"$OUT/logs/$f.log" 2>&1 \
      || { echo "client failed; see $OUT/logs/$f.log"; rm -f "$OUT/$f.json"; }
    curl -s "$url/metrics" >"$OUT/$f.metrics-after"
    echo "  $f: $(grep -E "Output token throughput" "$OUT/logs/$f.log" | tr -s ' ')"
  done
}

if [[ ",$STEPS," == *,serve,* ]]; then
  TOKENIZER=${TOKENIZER:-$("$PEERS" model-dir)} || { echo "no tokenizer: run peers.sh setup or set TOKENIZER" >&2; exit 2; }
  read -r -a engines <<<"$ENGINES"
  for run in $(seq 1 "$RUNS"); do
    for j in $(seq 0 $((${#engines[@]} - 1))); do
      engine=${engines[$(((j + run - 1) % ${#engines[@]}))]}
      echo "run $run: $engine (load $(cut -d' ' -f1-3 /proc/loadavg))"
      if start_engine "$engine"; then
        measure "$engine" "$run" "$URL"
      else
        echo "  $engine did not start; see $OUT/logs/$engine.log"
        touch "$OUT/$engine-failed-run$run"
      fi
      stop_engine "$engine"
    done
  done
fi
if [[ ",$STEPS," == *,report,* ]]; then
  "$PY" "$ROOT/benchmarks/spec_decode_table.py" "$OUT" | tee "$OUT/table.md"
fi
