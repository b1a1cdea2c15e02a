#!/usr/bin/env bash
# Cold start: seconds from launching `pagedllm serve` (default model) to the first 200 from /health,
# and from launching LLM() to a constructed engine. Usage: benchmarks/cold_start.sh [runs] [port]
# SERVE_FLAGS: more serve flags (e.g. "--pipeline-parallel-size 2 --distributed-executor-backend ray", on a Ray
# cluster started before); SKIP_LLM=1 leaves out LLM(); PAGEDLLM: the command (default .venv/bin/pagedllm).
set -u
cd "$(dirname "$0")/.."
runs=${1:-3}; port=${2:-18777}
for i in $(seq "$runs"); do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # PAGEDLLM and SERVE_FLAGS are word lists
  ${PAGEDLLM:-.venv/bin/pagedllm} serve --port "$port" --host 127.0.0.1 ${SERVE_FLAGS:-} >/tmp/pagedllm-cold-$port.log 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "serve died"; tail -5 /tmp/pagedllm-cold-$port.log; break; }
    sleep 0.1
  done
  end=$(date +%s.%N)
  echo "{\"what\": \"serve_to_health\", \"flags\": \"${SERVE_FLAGS:-}\", \"run\": $i, \"seconds\": $(echo "$end - $start" | bc), \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
  kill -TERM $pid; wait $pid 2>/dev/null
done
[ -n "${SKIP_LLM:-}" ] && exit 0
for i in $(seq "$runs"); do
  .venv/bin/python - <<'PY'
import json, os, time
start = time.perf_counter()
from pagedllm import LLM
LLM()
print(json.dumps({"what": "LLM()", "seconds": round(time.perf_counter() - start, 2),
                  "load": " ".join(open("/proc/loadavg").read().split()[:3])}))
PY
done
