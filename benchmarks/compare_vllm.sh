#!/usr/bin/env bash
# pagedllm against vLLM's CPU build, end to end, one command (issue #5, items 2-4):
#
#   benchmarks/compare_vllm.sh                 # full sweep: RUNS=2, results in benchmarks/results/,
#                                              # the compare_vllm section of benchmarks/RESULTS.md, the PNG
#   QUICK=1 RUNS=1 benchmarks/compare_vllm.sh  # smoke test: few prompts, results in /tmp/pagedllm-compare-quick
#
# Needs ../shared/bench/peers.sh with `peers.sh setup` done (vLLM's CPU build and the bf16 SmolLM2 folder).
# One server at a time, the engines alternating (odd runs vLLM first, even runs pagedllm first):
#   serve    per run and engine: start the server and time it to a healthy /health (cold start), the standard
#            serving workload through `peers.sh bench` (one client, `vllm bench serve`, for both engines) at
#            concurrency 1/4/16/64, then the server's resident memory (VmRSS and peak VmHWM, summed over the
#            API-server and engine-core processes), then stop it
#   offline  per run: `peers.sh offline` (vLLM LLM.generate, 2 timed batches) and `pagedllm bench throughput`
#            on the standard offline workload (128 prompts x 256 random ids, 128 output tokens, greedy)
#   prefix   per run: pagedllm serving `bench serve --dataset-name prefix-repetition` (1,024-token shared
#            prefix, 128 unique, 128 out, concurrency 16, 64 prompts) with prefix caching and with
#            --no-enable-prefix-caching; the /metrics prefix-cache counters before and after
# Every measurement is logged with the load average to $OUT/runs.jsonl; then summarize_results.py writes the
# tables and plot_results.py the PNG.
#
# Environment: RUNS (2), QUICK (0), STEPS (serve,offline,prefix), OUT (benchmarks/results; QUICK:
# /tmp/pagedllm-compare-quick), RESULTS_MD (benchmarks/RESULTS.md; QUICK or another OUT: $OUT/RESULTS.md), PAGEDLLM_PORT
# (8001), PREFIX_OUTPUT_LEN (128), OFFLINE_N, PREFIX_N, WORKLOADS, ENGINES ("vllm pagedllm"), VLLM_DTYPE,
# VLLM_OFFLINE_RUNS, PAGEDLLM_SERVE_ARGS (--health-check-timeout 60), PAGEDLLM_ARGS (--dtype auto: float32 on a CPU without AMX/AVX512-BF16), PEERS_SH, PEERS_DIR,
# LOGS (server logs, /tmp/pagedllm-compare-logs).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PEERS=${PEERS_SH:-$ROOT/../shared/bench/peers.sh}
export PEERS_DIR=${PEERS_DIR:-/tmp/pagedllm-peers}
RUNS=${RUNS:-2}
QUICK=${QUICK:-0}
STEPS=${STEPS:-serve,offline,prefix}
PORT=${PAGEDLLM_PORT:-8001}
VLLM_PORT=8000
read -r -a PAGEDLLM_ARGS <<<"${PAGEDLLM_ARGS:---dtype auto}"
# serve only: on this shared machine one engine step can take over the default 10 s under load (seen: the
# first 256-token prefill while another process compiled), which turns /health to 503 and ends the server.
read -r -a PAGEDLLM_SERVE_ARGS <<<"${PAGEDLLM_SERVE_ARGS:---health-check-timeout 60}"
PY=$ROOT/.venv/bin/python
PAGEDLLM=$ROOT/.venv/bin/pagedllm
LOGS=${LOGS:-/tmp/pagedllm-compare-logs}
MODEL_DIR=$("$PEERS" model-dir)
ENGINES=${ENGINES:-"vllm pagedllm"}
PREFIX_OUTPUT_LEN=${PREFIX_OUTPUT_LEN:-128}
# vLLM's dtype: peers.sh's bfloat16 where the CPU has native bf16 (AMX or AVX512-BF16), else float32, the
# dtype `pagedllm --dtype auto` picks there too. On an AVX2-only CPU vLLM's bf16 falls back from oneDNN to
# torch's emulated bf16 matmuls and runs ~10x slower than fp32 (prefill ~200 tok/s, decode ~13 tok/s at
# concurrency 16), so bf16 there would be a straw man and take hours.
if grep -qwE 'amx_bf16|avx512_bf16' /proc/cpuinfo; then VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}; else VLLM_DTYPE=${VLLM_DTYPE:-float32}; fi
if [ "$QUICK" = 1 ]; then
  WORKLOADS=${WORKLOADS:-"1:4 4:8 16:16 64:64"}; OFFLINE_N=${OFFLINE_N:-32}; PREFIX_N=${PREFIX_N:-32}
  OUT=${OUT:-/tmp/pagedllm-compare-quick}
else
  WORKLOADS=${WORKLOADS:-"1:16 4:32 16:64 64:128"}; OFFLINE_N=${OFFLINE_N:-128}; PREFIX_N=${PREFIX_N:-64}
  # A sweep into another OUT (a partial STEPS=... run) writes its tables there too, not over the committed ones.
  if [ -z "${OUT:-}" ]; then OUT=$ROOT/benchmarks/results; RESULTS_MD=${RESULTS_MD:-$ROOT/benchmarks/RESULTS.md}; fi
fi
RESULTS_MD=${RESULTS_MD:-$OUT/RESULTS.md}
mkdir -p "$OUT" "$LOGS"
rm -rf "$OUT/serve" "$OUT/offline" "$OUT/prefix" "$OUT/runs.jsonl" "$OUT/sweep.json"
mkdir -p "$OUT/serve" "$OUT/offline" "$OUT/prefix"

say() { echo "[$(date +%H:%M:%S) load $(loadavg)] $*"; }
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
now() { date +%s.%N; }
record() {  # key=value ... -> one JSON line in $OUT/runs.jsonl (numbers, true/false/null and JSON parsed)
  "$PY" - "$@" >>"$OUT/runs.jsonl" <<'PY'
import json, sys
d = {}
for arg in sys.argv[1:]:
    k, v = arg.split("=", 1)
    try:
        d[k] = json.loads(v)
    except ValueError:
        d[k] = v
print(json.dumps(d))
PY
}
tree_pids() { local p; for p in "$@"; do echo "$p"; tree_pids $(pgrep -P "$p"); done; }
tree_mem() {  # PID -> "RSS_KiB HWM_KiB NPROCS" summed over the process and its descendants
  local rss=0 hwm=0 n=0 p r h
  for p in $(tree_pids "$1"); do
    r=$(awk '/^VmRSS:/{print $2}' "/proc/$p/status" 2>/dev/null); h=$(awk '/^VmHWM:/{print $2}' "/proc/$p/status" 2>/dev/null)
    [ -n "$r" ] || continue
    rss=$((rss + r)); hwm=$((hwm + ${h:-0})); n=$((n + 1))
  done
  echo "$rss $hwm $n"
}
port_busy() { curl -s -o /dev/null "http://127.0.0.1:$1/health"; }

PD_PID=""
start_pagedllm() {  # LOGFILE [extra serve flags] -> PD_PID, COLD_S
  local log=$1; shift
  if port_busy "$PORT"; then echo "port $PORT is already serving: stop that server first" >&2; return 1; fi
  local t0; t0=$(now)
  "$PAGEDLLM" serve --host 127.0.0.1 --port "$PORT" --served-model-name smollm2 --max-model-len 2048 \
    "${PAGEDLLM_ARGS[@]}" "${PAGEDLLM_SERVE_ARGS[@]}" "$@" >"$log" 2>&1 &
  PD_PID=$!
  until curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; do
    kill -0 "$PD_PID" 2>/dev/null || { echo "pagedllm serve exited; see $log" >&2; PD_PID=""; return 1; }
    (( $(echo "$(now) - $t0 > 600" | bc) )) && { echo "pagedllm not healthy after 600 s" >&2; return 1; }
    sleep 0.05
  done
  COLD_S=$(echo "$(now) - $t0" | bc)
}
stop_pagedllm() {
  [ -n "$PD_PID" ] || return 0
  local pids; pids=$(tree_pids "$PD_PID")
  kill -TERM "$PD_PID" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$PD_PID" 2>/dev/null || break; sleep 0.3; done
  for p in $pids; do kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null; done
  wait "$PD_PID" 2>/dev/null
  PD_PID=""
}
VLLM_STARTED=0
cleanup() { stop_pagedllm; if [ "$VLLM_STARTED" = 1 ]; then "$PEERS" stop >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
trap 'exit 130' INT TERM

bench_serve() {  # ENGINE RUN URL: the standard serving workloads, one `peers.sh bench` call per workload
  local engine=$1 run=$2 url=$3 label="$1-run$2" w c n f dir
  dir=$OUT/serve/$label; mkdir -p "$dir"
  for w in $WORKLOADS; do
    c=${w%%:*}; n=${w##*:}; f=${label}_c${c}_n${n}
    if ! curl -sf -o /dev/null "$url/health"; then
      echo "$engine server at $url is not healthy: skipping its remaining workloads" >&2
      record step=serve engine="$engine" run="$run" concurrency="$c" num_prompts="$n" failed=true \
        log="server unhealthy before this workload" load_before="$(loadavg)"
      continue
    fi
    rm -f "$PEERS_DIR/results/$label/$f.json"
    local lb t0; lb=$(loadavg); t0=$(date -Is)
    "$PEERS" bench "$url" smollm2 "$label" "$w"
    if [ -f "$PEERS_DIR/results/$label/$f.json" ]; then
      cp "$PEERS_DIR/results/$label/$f.json" "$dir/"
      record step=serve engine="$engine" run="$run" concurrency="$c" num_prompts="$n" file="serve/$label/$f.json" \
        started="$t0" load_before="$lb" load_after="$(loadavg)"
    else
      cp "$PEERS_DIR/results/$label/$f.log" "$dir/" 2>/dev/null
      record step=serve engine="$engine" run="$run" concurrency="$c" num_prompts="$n" failed=true \
        log="serve/$label/$f.log" started="$t0" load_before="$lb" load_after="$(loadavg)"
    fi
  done
}

serve_vllm() {
  local run=$1 t0 out lb; say "vLLM serve run $run: starting"
  port_busy $VLLM_PORT && { echo "port $VLLM_PORT busy; skipping vLLM run $run" >&2; return; }
  lb=$(loadavg); t0=$(now); VLLM_STARTED=1
  if ! out=$("$PEERS" serve-vllm --dtype "$VLLM_DTYPE" 2>&1); then
    echo "$out"; cp "$PEERS_DIR/logs/vllm-serve.log" "$LOGS/vllm-serve-run$run.log" 2>/dev/null
    record step=server engine=vllm run="$run" failed=true load="$lb" log="$LOGS/vllm-serve-run$run.log"
    "$PEERS" stop; VLLM_STARTED=0; return
  fi
  local cold; cold=$(echo "$(now) - $t0" | bc); echo "$out"
  bench_serve vllm "$run" "http://127.0.0.1:$VLLM_PORT"
  local mem; mem=($(tree_mem "$(cat "$PEERS_DIR/logs/vllm.pid")"))
  cp "$PEERS_DIR/logs/vllm-serve.log" "$LOGS/vllm-serve-run$run.log" 2>/dev/null
  local kv; kv=$(grep -oE 'set \(([0-9.]+)/' "$PEERS_DIR/logs/vllm-serve.log" | grep -oE '[0-9.]+' | head -1)
  record step=server engine=vllm run="$run" cold_start_s="$cold" \
    peers_healthy_after="$(echo "$out" | grep -oE 'healthy after [0-9]+' | grep -oE '[0-9]+$')" \
    rss_mib=$((mem[0] / 1024)) hwm_mib=$((mem[1] / 1024)) nprocs="${mem[2]}" kv_pool_mib="$(echo "${kv:-0} * 1024" | bc)" \
    load_at_start="$lb" load_at_end="$(loadavg)"
  "$PEERS" stop; VLLM_STARTED=0
}

serve_pagedllm() {
  local run=$1 lb log=$LOGS/pagedllm-serve-run$1.log; say "pagedllm serve run $run: starting"
  lb=$(loadavg)
  if ! start_pagedllm "$log"; then
    stop_pagedllm; record step=server engine=pagedllm run="$run" failed=true load="$lb" log="$log"; return
  fi
  say "pagedllm healthy after $COLD_S s"
  local cold=$COLD_S mem_idle; mem_idle=($(tree_mem "$PD_PID"))
  bench_serve pagedllm "$run" "http://127.0.0.1:$PORT"
  local mem; mem=($(tree_mem "$PD_PID"))
  record step=server engine=pagedllm run="$run" cold_start_s="$cold" rss_idle_mib=$((mem_idle[0] / 1024)) \
    rss_mib=$((mem[0] / 1024)) hwm_mib=$((mem[1] / 1024)) nprocs="${mem[2]}" \
    $("$PY" benchmarks/summarize_results.py --parse-log "$log" --model-dir "$MODEL_DIR") \
    load_at_start="$lb" load_at_end="$(loadavg)"
  stop_pagedllm
}

offline_vllm() {  # each call times 2 batches in one process; VLLM_OFFLINE_RUNS (default RUNS) calls
  local run=$1 lb t0 f=$OUT/offline/vllm-run$1.jsonl
  (( run > ${VLLM_OFFLINE_RUNS:-$RUNS} )) && return
  say "vLLM offline run $run"
  lb=$(loadavg); t0=$(date -Is)
  if [ "$VLLM_DTYPE" = bfloat16 ]; then
    "$PEERS" offline "$OFFLINE_N" 256 128 >"$LOGS/vllm-offline-run$run.log" 2>&1
  else  # peers.sh's offline_vllm.py is bf16 only: the same workload with LLM(dtype=VLLM_DTYPE)
    offline_vllm_dtype >"$LOGS/vllm-offline-run$run.log" 2>&1
  fi
  grep '^{"engine"' "$LOGS/vllm-offline-run$run.log" >"$f"
  if [ -s "$f" ]; then cat "$f"; record step=offline engine=vllm run="$run" file="offline/vllm-run$run.jsonl" \
      started="$t0" load_before="$lb" load_after="$(loadavg)"
  else tail -5 "$LOGS/vllm-offline-run$run.log"; record step=offline engine=vllm run="$run" failed=true load_before="$lb"; fi
}

offline_vllm_dtype() {  # ../shared/bench/offline_vllm.py with the dtype a parameter, in peers.sh's environment
  local script=$LOGS/offline_vllm_dtype.py
  sed -e 's/dtype="bfloat16"/dtype=os.environ["VLLM_DTYPE"]/' -e 's/^import json$/import json, os/' \
    "$(dirname "$PEERS")/offline_vllm.py" >"$script"
  grep -q 'os.environ\["VLLM_DTYPE"\]' "$script" || { echo "could not parametrize offline_vllm.py's dtype" >&2; return 1; }
  (
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
    local preload=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
    [ -f "$PEERS_DIR/venv/lib/libiomp5.so" ] && preload="$preload:$PEERS_DIR/venv/lib/libiomp5.so"
    [ -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && export LD_PRELOAD=$preload
    export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_DTYPE
    "$PEERS_DIR/venv/bin/python" "$script" "$MODEL_DIR" "$OFFLINE_N" 256 128
  )
}

offline_pagedllm() {
  local run=$1 lb t0 f=$OUT/offline/pagedllm-run$1.json; say "pagedllm offline run $run"
  lb=$(loadavg); t0=$(date -Is)
  "$PAGEDLLM" bench throughput --num-prompts "$OFFLINE_N" --input-len 256 --output-len 128 --output-json "$f" \
    "${PAGEDLLM_ARGS[@]}" >"$LOGS/pagedllm-offline-run$run.log" 2>&1
  if [ -s "$f" ]; then grep -E "^Throughput" "$LOGS/pagedllm-offline-run$run.log"
    record step=offline engine=pagedllm run="$run" file="offline/pagedllm-run$run.json" started="$t0" \
      load_before="$lb" load_after="$(loadavg)"
  else tail -5 "$LOGS/pagedllm-offline-run$run.log"; record step=offline engine=pagedllm run="$run" failed=true load_before="$lb"; fi
}

serve_flag() {  # NAME DEFAULT -> the value of pagedllm serve's --NAME in PAGEDLLM_ARGS/PAGEDLLM_SERVE_ARGS, else DEFAULT
  local args=("${PAGEDLLM_ARGS[@]}" "${PAGEDLLM_SERVE_ARGS[@]}") i value=$2
  for i in "${!args[@]}"; do [ "${args[$i]}" = "--$1" ] && value=${args[$((i + 1))]}; done
  echo "$value"
}
prefix_counters() { curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^vllm:prefix_cache_queries_total/{q=$NF} /^vllm:prefix_cache_hits_total/{h=$NF} END{printf "%d %d\n", q, h}'; }
prefix_run() {  # RUN on|off
  local run=$1 mode=$2 log=$LOGS/pagedllm-prefix-$2-run$1.log name=prefix-$2-run$1 extra=()
  [ "$mode" = off ] && extra=(--no-enable-prefix-caching)
  say "pagedllm prefix-repetition run $run, prefix caching $mode"
  start_pagedllm "$log" "${extra[@]}" || { stop_pagedllm; record step=prefix caching="$mode" run="$run" failed=true; return; }
  local before after lb t0; before=($(prefix_counters)); lb=$(loadavg); t0=$(date -Is)
  "$PAGEDLLM" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
    --model smollm2 --tokenizer "$MODEL_DIR" --dataset-name prefix-repetition --prefix-repetition-prefix-len 1024 \
    --prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 1 --prefix-repetition-output-len "$PREFIX_OUTPUT_LEN" \
    --ignore-eos --max-concurrency 16 --num-prompts "$PREFIX_N" --seed "$run" --disable-tqdm \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT/prefix" --result-filename "$name.json" >"$LOGS/$name-bench.log" 2>&1
  after=($(prefix_counters))
  grep -E "Median TTFT|Output token throughput" "$LOGS/$name-bench.log"
  record step=prefix caching="$mode" run="$run" file="prefix/$name.json" num_prompts="$PREFIX_N" prefix_len=1024 \
    suffix_len=128 output_len="$PREFIX_OUTPUT_LEN" num_prefixes=1 block_size="$(serve_flag block-size 16)" \
    max_num_batched_tokens="$(serve_flag max-num-batched-tokens 2048)" concurrency=16 \
    queries_delta=$((after[0] - before[0])) hits_delta=$((after[1] - before[1])) started="$t0" \
    load_before="$lb" load_after="$(loadavg)"
  stop_pagedllm
}

COMMIT=$(git rev-parse HEAD); DIRTY=$(git status --porcelain --untracked-files=no -- src | wc -l)
record step=sweep date="$(date -Is)" commit="$COMMIT" dirty_src_files="$DIRTY" runs="$RUNS" quick="$QUICK" \
  workloads="$WORKLOADS" offline_prompts="$OFFLINE_N" prefix_prompts="$PREFIX_N" \
  pagedllm_args="${PAGEDLLM_ARGS[*]}" pagedllm_serve_args="${PAGEDLLM_SERVE_ARGS[*]}" vllm_dtype="$VLLM_DTYPE" vllm_offline_runs="${VLLM_OFFLINE_RUNS:-$RUNS}" engines="$ENGINES" cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')" \
  nproc="$(nproc)" load="$(loadavg)"
say "sweep: RUNS=$RUNS QUICK=$QUICK steps=$STEPS commit ${COMMIT:0:10} (+$DIRTY modified files under src/) -> $OUT"

order() {  # RUN -> the engines of $ENGINES, vLLM first on odd runs, pagedllm first on even ones
  local e out=()
  for e in vllm pagedllm; do [[ " $ENGINES " == *" $e "* ]] && out+=("$e"); done
  if (( $1 % 2 == 0 )); then echo "${out[@]}" | tr ' ' '\n' | tac | tr '\n' ' '; else echo "${out[@]}"; fi
}
for run in $(seq "$RUNS"); do
  [[ ",$STEPS," == *,serve,* ]] || break
  for e in $(order "$run"); do "serve_$e" "$run"; done
done
for run in $(seq "$RUNS"); do
  [[ ",$STEPS," == *,offline,* ]] || break
  for e in $(order "$run"); do "offline_$e" "$run"; done
done
for run in $(seq "$RUNS"); do
  [[ ",$STEPS," == *,prefix,* ]] || break
  if (( run % 2 )); then prefix_run "$run" on; prefix_run "$run" off; else prefix_run "$run" off; prefix_run "$run" on; fi
done
record step=sweep_end date="$(date -Is)" load="$(loadavg)"

"$PY" benchmarks/summarize_results.py "$OUT" --results-md "$RESULTS_MD"
"$PY" benchmarks/plot_results.py "$OUT" --output "$OUT/throughput_ttft.png"
say "done: $RESULTS_MD, $OUT/throughput_ttft.png"
