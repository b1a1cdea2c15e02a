#!/usr/bin/env bash
# pagedllm against vLLM's CPU build and llama.cpp, end to end, one command (issue #5, items 2-4; issue #12):
#
#   benchmarks/compare_vllm.sh                 # full sweep: RUNS=2, results in benchmarks/results/,
#                                              # the compare_vllm section of benchmarks/RESULTS.md, the PNG
#   QUICK=1 RUNS=1 benchmarks/compare_vllm.sh  # smoke test: few prompts, results in /tmp/pagedllm-compare-quick
#   ENGINES="vllm llamacpp pagedllm pagedllm-fast" PAGEDLLM_EXTRA_FLAGS_FAST="--some-flag" benchmarks/compare_vllm.sh
#                                              # two pagedllm modes against the peers in one sitting
#   STEPS=report benchmarks/compare_vllm.sh    # only the tables and the plot, from the results in OUT
#
# Needs ../shared/bench/peers.sh with `peers.sh setup` done (vLLM's CPU build and the bf16 SmolLM2 folder) and,
# for llama.cpp, `peers.sh setup-llamacpp`. One server at a time, the engines' order rotating run by run (run 1
# in ENGINES' order, run 2 starting from the second engine, ...; with two engines they alternate):
#   serve    per run and engine: start the server and time it to a healthy /health (cold start), the standard
#            serving workload (random 256-token prompts, 128 output tokens, ignore_eos) at concurrency
#            1/4/16/64, then the server's resident memory (VmRSS and peak VmHWM, summed over the server's
#            processes), then stop it
#   offline  per run: `peers.sh offline` (vLLM LLM.generate, 2 timed batches) and `pagedllm bench throughput`
#            per pagedllm engine on the standard offline workload (128 prompts x 256 random ids, 128 output
#            tokens, greedy); llama.cpp has no offline counterpart here
#   prefix   per run: pagedllm (PREFIX_ENGINE) serving `bench serve --dataset-name prefix-repetition` (1,024-token
#            shared prefix, 128 unique, 128 out, concurrency 16, 64 prompts) with prefix caching and with
#            --no-enable-prefix-caching; the /metrics prefix-cache counters before and after
#   report   (always last) summarize_results.py writes the tables, plot_results.py the PNG; alone in STEPS it
#            measures nothing and keeps OUT's results
# Every measurement is logged with the load average to $OUT/runs.jsonl.
#
# Engines (ENGINES, default "vllm pagedllm llamacpp"): vllm (`peers.sh serve-vllm`, port 8000), llamacpp
# (`peers.sh serve-llamacpp`, port 8002: the Q4_1 GGUF in its 4-bit form, LLAMACPP_NP slots; LLAMACPP_ARGS go to
# llama-server), pagedllm (port PAGEDLLM_PORT) and any pagedllm-NAME: a pagedllm mode, served and run offline
# with PAGEDLLM_ARGS plus its own flags, PAGEDLLM_EXTRA_FLAGS for pagedllm and PAGEDLLM_EXTRA_FLAGS_NAME (NAME in
# capitals, "-" as "_") for pagedllm-NAME. The pagedllm engine named plainly is the lossless default mode.
# PAGEDLLM_SRC_NAME runs pagedllm-NAME from another source tree (its PYTHONPATH, ahead of the editable install):
# an earlier commit against this one in one sitting, e.g. `git archive 9c0cf5c src | tar -x -C /tmp/base` and
# ENGINES="pagedllm pagedllm-base" PAGEDLLM_SRC_BASE=/tmp/base/src STEPS=serve.
#
# Client (CLIENT): pagedllm (default) measures every engine with `pagedllm bench serve`; vllm measures vLLM and
# pagedllm with `vllm bench serve` through `peers.sh bench` (the client of the sweeps before llama.cpp joined),
# llama.cpp still with `pagedllm bench serve`. vLLM's client reads `usage` only from a chunk without choices, and
# llama.cpp's last chunk carries it beside a choice, so vLLM's client re-tokenizes llama.cpp's text and counts
# ~8% fewer output tokens than the server generated (output tok/s and TPOT off by that much); pagedllm's client
# reads that usage. One client for all three keeps every ratio (pagedllm / vLLM, pagedllm / llama.cpp) a
# same-client ratio; it computes vLLM's metrics by vLLM's definitions (tests/bench). Prompts: random token ids
# with seed C*1000 + N*10 + RUN, so every engine of a run gets the same prompts (peers.sh bench draws its seed).
#
# Environment: RUNS (2), FIRST_RUN (1: the runs are FIRST_RUN..RUNS, seeds and engine order as in a full sweep), QUICK (0), STEPS (serve,offline,prefix), ENGINES, CLIENT, OUT (benchmarks/results;
# QUICK: /tmp/pagedllm-compare-quick), RESULTS_MD (benchmarks/RESULTS.md; QUICK or another OUT: $OUT/RESULTS.md),
# PAGEDLLM_PORT (8001), INPUT_LEN (256) and OUTPUT_LEN (128; the serving and offline workloads, CLIENT=vllm: only
# 256/128), PREFIX_OUTPUT_LEN (128), OFFLINE_N, PREFIX_N, PREFIX_ENGINE (the first pagedllm engine), WORKLOADS ("C:N ..."),
# VLLM_DTYPE, VLLM_OFFLINE_RUNS, PAGEDLLM_SERVE_ARGS (--health-check-timeout 60), PAGEDLLM_ARGS (--dtype auto:
# float32 for the GGUF default), PAGEDLLM_EXTRA_FLAGS[_NAME], LLAMACPP_NP (16), LLAMACPP_ARGS,
# PEERS_SH, PEERS_DIR, PY and PAGEDLLM (.venv's python and pagedllm), LOGS (server logs, /tmp/pagedllm-compare-logs).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PEERS=${PEERS_SH:-$ROOT/../shared/bench/peers.sh}
export PEERS_DIR=${PEERS_DIR:-/tmp/pagedllm-peers}
RUNS=${RUNS:-2}
FIRST_RUN=${FIRST_RUN:-1}  # a later sitting adds run FIRST_RUN..RUNS to an earlier one (their runs.jsonl appended)
QUICK=${QUICK:-0}
STEPS=${STEPS:-serve,offline,prefix}
PORT=${PAGEDLLM_PORT:-8001}
VLLM_PORT=8000
LLAMACPP_PORT=8002
CLIENT=${CLIENT:-pagedllm}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
export LLAMACPP_NP=${LLAMACPP_NP:-16}
read -r -a LLAMACPP_ARGS <<<"${LLAMACPP_ARGS:-}"
read -r -a PAGEDLLM_ARGS <<<"${PAGEDLLM_ARGS:---dtype auto}"
# serve only: on this shared machine one engine step can take over the default 10 s under load (seen: the
# first 256-token prefill while another process compiled), which turns /health to 503 and ends the server.
read -r -a PAGEDLLM_SERVE_ARGS <<<"${PAGEDLLM_SERVE_ARGS:---health-check-timeout 60}"
PY=${PY:-$ROOT/.venv/bin/python}
PAGEDLLM=${PAGEDLLM:-$ROOT/.venv/bin/pagedllm}
LOGS=${LOGS:-/tmp/pagedllm-compare-logs}
if [ ! -x "$PEERS" ]; then echo "no $PEERS: set PEERS_SH to ../shared/bench/peers.sh" >&2; exit 2; fi
MODEL_DIR=$("$PEERS" model-dir)
ENGINES=${ENGINES:-"vllm pagedllm llamacpp"}
for e in $ENGINES; do
  case $e in vllm | llamacpp | pagedllm | pagedllm-*) ;; *) echo "unknown engine $e in ENGINES" >&2; exit 2 ;; esac
done
case $CLIENT in pagedllm | vllm) ;; *) echo "CLIENT is pagedllm or vllm, not $CLIENT" >&2; exit 2 ;; esac
if [ "$CLIENT" = vllm ] && [ "$INPUT_LEN:$OUTPUT_LEN" != 256:128 ]; then
  echo "CLIENT=vllm (peers.sh bench) runs 256-token prompts and 128 output tokens only" >&2; exit 2
fi
PAGEDLLM_ENGINES=$(for e in $ENGINES; do [[ $e == pagedllm* ]] && echo "$e"; done)
PREFIX_ENGINE=${PREFIX_ENGINE:-$(echo "$PAGEDLLM_ENGINES" | head -1)}
MEASURE=0
for s in serve offline prefix; do [[ ",$STEPS," == *,$s,* ]] && MEASURE=1; done
PREFIX_OUTPUT_LEN=${PREFIX_OUTPUT_LEN:-128}
# vLLM's dtype: peers.sh's bfloat16 where the CPU has native bf16 (AMX or AVX512-BF16), else float32 (for a
# Hugging Face checkpoint `pagedllm --dtype auto` picks the same; the default GGUF model keeps its quantized
# kernels' float32 everywhere). On an AVX2-only CPU vLLM's bf16 falls back from oneDNN to
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
if [ "$MEASURE" = 1 ]; then
  # a new sweep starts from nothing; a later sitting (FIRST_RUN > 1) keeps the earlier runs' files
  [ "$FIRST_RUN" = 1 ] && rm -rf "$OUT/serve" "$OUT/offline" "$OUT/prefix" "$OUT/runs.jsonl" "$OUT/sweep.json"
  mkdir -p "$OUT/serve" "$OUT/offline" "$OUT/prefix"
fi

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
PD_ENV=""  # the engine's environment (variant_env), set by its caller
start_pagedllm() {  # LOGFILE [extra serve flags] -> PD_PID, COLD_S
  local log=$1; shift
  if port_busy "$PORT"; then echo "port $PORT is already serving: stop that server first" >&2; return 1; fi
  local t0; t0=$(now)
  env $PD_ENV "$PAGEDLLM" serve --host 127.0.0.1 --port "$PORT" --served-model-name smollm2 --max-model-len 2048 \
    "${PAGEDLLM_ARGS[@]}" "${PAGEDLLM_SERVE_ARGS[@]}" "$@" >"$log" 2>&1 &
  PD_PID=$!
  until curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; do
    kill -0 "$PD_PID" 2>/dev/null || { echo "pagedllm serve exited; see $log" >&2; PD_PID=""; return 1; }
    (( $(echo "$(now) - $t0 > 600" | bc) )) && { echo "pagedllm not healthy after 600 s" >&2; return 1; }
    sleep 0.05
  done
  COLD_S=$(printf "%.3f" "$(echo "$(now) - $t0" | bc)")  # bc writes 0.89 as .89, not JSON
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
PEER_STARTED=0
stop_peer() {  # `peers.sh stop`, then SIGKILL what is left of the server's process tree: peers.sh waits 30 s
  # after SIGTERM and then forgets the server, and a vLLM still compiling at its start-up timeout outlives that
  local f pids=""
  for f in "$PEERS_DIR/logs/vllm.pid" "$PEERS_DIR/logs/llamacpp.pid"; do [ -f "$f" ] && pids+=" $(tree_pids "$(cat "$f")")"; done
  "$PEERS" stop
  for f in $pids; do kill -0 "$f" 2>/dev/null && kill -KILL "$f" 2>/dev/null; done
  PEER_STARTED=0
}
cleanup() { stop_pagedllm; if [ "$PEER_STARTED" = 1 ]; then stop_peer >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
trap 'exit 130' INT TERM

client_of() {  # ENGINE -> the client that measures it (see CLIENT above)
  if [ "$CLIENT" = vllm ] && [ "$1" != llamacpp ]; then echo vllm; else echo pagedllm; fi
}
bench_one() {  # CLIENT URL LABEL C N RUN DIR: one workload; leaves DIR/LABEL_cC_nN.json (or only its .log)
  local client=$1 url=$2 label=$3 c=$4 n=$5 run=$6 dir=$7 f=${3}_c${4}_n${5}
  if [ "$client" = vllm ]; then
    rm -f "$PEERS_DIR/results/$label/$f.json"
    "$PEERS" bench "$url" smollm2 "$label" "$c:$n"
    cp "$PEERS_DIR/results/$label/$f.json" "$PEERS_DIR/results/$label/$f.log" "$dir/" 2>/dev/null
  else
    echo "=== $label concurrency $c, $n prompts"
    "$PAGEDLLM" bench serve --backend openai --base-url "$url" --endpoint /v1/completions --model smollm2 \
      --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len "$INPUT_LEN" \
      --random-output-len "$OUTPUT_LEN" --ignore-eos --seed $((c * 1000 + n * 10 + run)) --num-prompts "$n" \
      --max-concurrency "$c" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm \
      --label "$label" --save-result --result-dir "$dir" --result-filename "$f.json" >"$dir/$f.log" 2>&1 \
      || { echo "client failed; see $dir/$f.log"; rm -f "$dir/$f.json"; return; }
    grep -E "Successful requests|Output token throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL" "$dir/$f.log"
  fi
}
bench_serve() {  # ENGINE RUN URL: the standard serving workloads, one client call per workload
  local engine=$1 run=$2 url=$3 label="$1-run$2" client w c n f dir
  client=$(client_of "$engine")
  dir=$OUT/serve/$label; mkdir -p "$dir"
  for w in $WORKLOADS; do
    c=${w%%:*}; n=${w##*:}; f=${label}_c${c}_n${n}
    if ! curl -sf -o /dev/null "$url/health"; then
      echo "$engine server at $url is not healthy: skipping its remaining workloads" >&2
      record step=serve engine="$engine" run="$run" concurrency="$c" num_prompts="$n" failed=true \
        log="server unhealthy before this workload" load_before="$(loadavg)"
      continue
    fi
    local lb t0; lb=$(loadavg); t0=$(date -Is)
    bench_one "$client" "$url" "$label" "$c" "$n" "$run" "$dir"
    if [ -f "$dir/$f.json" ]; then
      record step=serve engine="$engine" run="$run" concurrency="$c" num_prompts="$n" file="serve/$label/$f.json" \
        client="$client" input_len="$INPUT_LEN" output_len="$OUTPUT_LEN" started="$t0" \
        load_before="$lb" load_after="$(loadavg)"
    else
      record step=serve engine="$engine" run="$run" concurrency="$c" num_prompts="$n" failed=true client="$client" \
        log="serve/$label/$f.log" started="$t0" load_before="$lb" load_after="$(loadavg)"
    fi
  done
}

start_peer() {  # PORT LOG SUBCOMMAND [ARGS]: `peers.sh SUBCOMMAND` in the background, /health polled every 50 ms
  # (peers.sh polls every second) -> COLD_S, the wall time to the first 200; returns peers.sh's status
  local port=$1 log=$2 t0 pid; shift 2
  t0=$(now); PEER_STARTED=1
  "$PEERS" "$@" >"$log" 2>&1 &
  pid=$!
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  COLD_S=$(printf "%.3f" "$(echo "$(now) - $t0" | bc)")  # bc writes 0.89 as .89, not JSON
  wait "$pid"
}

serve_vllm() {
  local run=$1 out lb; say "vLLM serve run $run: starting"
  port_busy $VLLM_PORT && { echo "port $VLLM_PORT busy; skipping vLLM run $run" >&2; return; }
  lb=$(loadavg)
  if ! start_peer $VLLM_PORT "$LOGS/vllm-start-run$run.log" serve-vllm --dtype "$VLLM_DTYPE"; then
    cat "$LOGS/vllm-start-run$run.log"; cp "$PEERS_DIR/logs/vllm-serve.log" "$LOGS/vllm-serve-run$run.log" 2>/dev/null
    record step=server engine=vllm run="$run" failed=true load="$lb" log="$LOGS/vllm-serve-run$run.log"
    stop_peer; return
  fi
  local cold=$COLD_S; out=$(cat "$LOGS/vllm-start-run$run.log"); echo "$out"
  bench_serve vllm "$run" "http://127.0.0.1:$VLLM_PORT"
  local mem; mem=($(tree_mem "$(cat "$PEERS_DIR/logs/vllm.pid")"))
  cp "$PEERS_DIR/logs/vllm-serve.log" "$LOGS/vllm-serve-run$run.log" 2>/dev/null
  local kv; kv=$(grep -oE 'set \(([0-9.]+)/' "$PEERS_DIR/logs/vllm-serve.log" | grep -oE '[0-9.]+' | head -1)
  record step=server engine=vllm run="$run" cold_start_s="$cold" \
    peers_healthy_after="$(echo "$out" | grep -oE 'healthy after [0-9]+' | grep -oE '[0-9]+$')" \
    rss_mib=$((mem[0] / 1024)) hwm_mib=$((mem[1] / 1024)) nprocs="${mem[2]}" kv_pool_mib="$(echo "${kv:-0} * 1024" | bc)" \
    load_at_start="$lb" load_at_end="$(loadavg)"
  stop_peer
}

serve_llamacpp() {
  local run=$1 lb log=$LOGS/llamacpp-start-run$1.log; say "llama.cpp serve run $run: starting"
  port_busy $LLAMACPP_PORT && { echo "port $LLAMACPP_PORT busy; skipping llama.cpp run $run" >&2; return; }
  lb=$(loadavg)
  if ! start_peer $LLAMACPP_PORT "$log" serve-llamacpp "${LLAMACPP_ARGS[@]}"; then
    cat "$log"; cp "$PEERS_DIR/logs/llamacpp-serve.log" "$LOGS/llamacpp-serve-run$run.log" 2>/dev/null
    record step=server engine=llamacpp run="$run" failed=true load="$lb" log="$LOGS/llamacpp-serve-run$run.log"
    stop_peer; return
  fi
  local cold=$COLD_S pid mem_idle; cat "$log"; pid=$(cat "$PEERS_DIR/logs/llamacpp.pid")
  mem_idle=($(tree_mem "$pid"))
  bench_serve llamacpp "$run" "http://127.0.0.1:$LLAMACPP_PORT"
  local mem; mem=($(tree_mem "$pid"))
  cp "$PEERS_DIR/logs/llamacpp-serve.log" "$LOGS/llamacpp-serve-run$run.log" 2>/dev/null
  record step=server engine=llamacpp run="$run" cold_start_s="$cold" rss_idle_mib=$((mem_idle[0] / 1024)) \
    rss_mib=$((mem[0] / 1024)) hwm_mib=$((mem[1] / 1024)) nprocs="${mem[2]}" load_at_start="$lb" \
    load_at_end="$(loadavg)"
  stop_peer
}

variant_var() {  # PREFIX ENGINE -> the variable PREFIX (pagedllm) or PREFIX_NAME (pagedllm-name)
  if [ "$2" = pagedllm ]; then echo "$1"; else echo "$1_$(echo "${2#pagedllm-}" | tr 'a-z-' 'A-Z_')"; fi
}
variant_flags() {  # ENGINE -> its extra flags: PAGEDLLM_EXTRA_FLAGS for pagedllm, PAGEDLLM_EXTRA_FLAGS_NAME for pagedllm-name
  local var; var=$(variant_var PAGEDLLM_EXTRA_FLAGS "$1")
  echo "${!var:-}"
}
variant_env() {  # ENGINE -> "PYTHONPATH=SRC" where PAGEDLLM_SRC_NAME gives it another source tree, else nothing
  local var; var=$(variant_var PAGEDLLM_SRC "$1")
  [ -z "${!var:-}" ] || echo "PYTHONPATH=${!var}"
}

serve_pagedllm() {  # ENGINE RUN
  local engine=$1 run=$2 lb log=$LOGS/$1-serve-run$2.log flags; say "$engine serve run $run: starting"
  read -r -a flags <<<"$(variant_flags "$engine")"
  PD_ENV=$(variant_env "$engine")
  lb=$(loadavg)
  if ! start_pagedllm "$log" "${flags[@]}"; then
    stop_pagedllm; record step=server engine="$engine" run="$run" failed=true load="$lb" log="$log"; return
  fi
  say "$engine healthy after $COLD_S s"
  local cold=$COLD_S mem_idle; mem_idle=($(tree_mem "$PD_PID"))
  bench_serve "$engine" "$run" "http://127.0.0.1:$PORT"
  local mem; mem=($(tree_mem "$PD_PID"))
  record step=server engine="$engine" run="$run" cold_start_s="$cold" rss_idle_mib=$((mem_idle[0] / 1024)) \
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
  # peers.sh offline reads the compute dtype from DTYPE
  DTYPE=$VLLM_DTYPE "$PEERS" offline "$OFFLINE_N" "$INPUT_LEN" "$OUTPUT_LEN" >"$LOGS/vllm-offline-run$run.log" 2>&1
  grep '^{"engine"' "$LOGS/vllm-offline-run$run.log" >"$f"
  if [ -s "$f" ]; then cat "$f"; record step=offline engine=vllm run="$run" file="offline/vllm-run$run.jsonl" \
      started="$t0" load_before="$lb" load_after="$(loadavg)"
  else tail -5 "$LOGS/vllm-offline-run$run.log"; record step=offline engine=vllm run="$run" failed=true load_before="$lb"; fi
}

offline_pagedllm() {  # ENGINE RUN
  local engine=$1 run=$2 lb t0 f=$OUT/offline/$1-run$2.json log=$LOGS/$1-offline-run$2.log flags
  say "$engine offline run $run"
  read -r -a flags <<<"$(variant_flags "$engine")"
  lb=$(loadavg); t0=$(date -Is)
  env $(variant_env "$engine") "$PAGEDLLM" bench throughput --num-prompts "$OFFLINE_N" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --output-json "$f" \
    "${PAGEDLLM_ARGS[@]}" "${flags[@]}" >"$log" 2>&1
  if [ -s "$f" ]; then grep -E "^Throughput" "$log"
    record step=offline engine="$engine" run="$run" file="offline/$engine-run$run.json" started="$t0" \
      load_before="$lb" load_after="$(loadavg)"
  else tail -5 "$log"; record step=offline engine="$engine" run="$run" failed=true load_before="$lb"; fi
}

serve_flag() {  # NAME DEFAULT -> the value of pagedllm serve's --NAME in the prefix engine's flags, else DEFAULT
  local args=("${PAGEDLLM_ARGS[@]}" "${PAGEDLLM_SERVE_ARGS[@]}") i value=$2 flags
  read -r -a flags <<<"$(variant_flags "$PREFIX_ENGINE")"
  args+=("${flags[@]}")
  for i in "${!args[@]}"; do [ "${args[$i]}" = "--$1" ] && value=${args[$((i + 1))]}; done
  echo "$value"
}
prefix_counters() { curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^vllm:prefix_cache_queries_total/{q=$NF} /^vllm:prefix_cache_hits_total/{h=$NF} END{printf "%d %d\n", q, h}'; }
prefix_run() {  # RUN on|off
  local run=$1 mode=$2 log=$LOGS/pagedllm-prefix-$2-run$1.log name=prefix-$2-run$1 extra=()
  read -r -a extra <<<"$(variant_flags "$PREFIX_ENGINE")"
  [ "$mode" = off ] && extra+=(--no-enable-prefix-caching)
  PD_ENV=$(variant_env "$PREFIX_ENGINE")
  say "$PREFIX_ENGINE prefix-repetition run $run, prefix caching $mode"
  start_pagedllm "$log" "${extra[@]}" || { stop_pagedllm; record step=prefix engine="$PREFIX_ENGINE" caching="$mode" run="$run" failed=true; return; }
  local before after lb t0; before=($(prefix_counters)); lb=$(loadavg); t0=$(date -Is)
  "$PAGEDLLM" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
    --model smollm2 --tokenizer "$MODEL_DIR" --dataset-name prefix-repetition --prefix-repetition-prefix-len 1024 \
    --prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 1 --prefix-repetition-output-len "$PREFIX_OUTPUT_LEN" \
    --ignore-eos --max-concurrency 16 --num-prompts "$PREFIX_N" --seed "$run" --disable-tqdm \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT/prefix" --result-filename "$name.json" >"$LOGS/$name-bench.log" 2>&1
  after=($(prefix_counters))
  grep -E "Median TTFT|Output token throughput" "$LOGS/$name-bench.log"
  record step=prefix engine="$PREFIX_ENGINE" caching="$mode" run="$run" file="prefix/$name.json" num_prompts="$PREFIX_N" prefix_len=1024 \
    suffix_len=128 output_len="$PREFIX_OUTPUT_LEN" num_prefixes=1 block_size="$(serve_flag block-size 16)" \
    max_num_batched_tokens="$(serve_flag max-num-batched-tokens 2048)" concurrency=16 \
    queries_delta=$((after[0] - before[0])) hits_delta=$((after[1] - before[1])) started="$t0" \
    load_before="$lb" load_after="$(loadavg)"
  stop_pagedllm
}

order() {  # RUN -> the engines of $ENGINES, rotated by RUN - 1 (with two engines: alternating)
  local e=($ENGINES) k
  k=$(( ($1 - 1) % ${#e[@]} ))
  echo "${e[@]:k}" "${e[@]:0:k}"
}
variants_json() {  # {"pagedllm": "FLAGS", "pagedllm-fast": "FLAGS"} of the pagedllm engines
  local e; for e in $PAGEDLLM_ENGINES; do printf '%s\0%s\0' "$e" "$(variant_flags "$e")"; done |
    "$PY" -c 'import json, sys; a = sys.stdin.read().split("\0")[:-1]; print(json.dumps(dict(zip(a[::2], a[1::2]))))'
}

if [ "$MEASURE" = 1 ]; then
  COMMIT=$(git rev-parse HEAD); DIRTY=$(git status --porcelain --untracked-files=no -- src | wc -l)
  record step=sweep date="$(date -Is)" commit="$COMMIT" dirty_src_files="$DIRTY" runs="$RUNS" first_run="$FIRST_RUN" quick="$QUICK" \
    workloads="$WORKLOADS" offline_prompts="$OFFLINE_N" prefix_prompts="$PREFIX_N" steps="$STEPS" \
    pagedllm_args="${PAGEDLLM_ARGS[*]}" pagedllm_serve_args="${PAGEDLLM_SERVE_ARGS[*]}" \
    pagedllm_variants="$(variants_json)" prefix_engine="$PREFIX_ENGINE" client="$CLIENT" \
    input_len="$INPUT_LEN" output_len="$OUTPUT_LEN" llamacpp_np="$LLAMACPP_NP" \
    llamacpp_args="${LLAMACPP_ARGS[*]}" vllm_dtype="$VLLM_DTYPE" vllm_offline_runs="${VLLM_OFFLINE_RUNS:-$RUNS}" \
    engines="$ENGINES" cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')" \
    nproc="$(nproc)" load="$(loadavg)"
  say "sweep: RUNS=$RUNS QUICK=$QUICK steps=$STEPS engines=$ENGINES client=$CLIENT commit ${COMMIT:0:10} (+$DIRTY modified files under src/) -> $OUT"
  for run in $(seq "$FIRST_RUN" "$RUNS"); do
    [[ ",$STEPS," == *,serve,* ]] || break
    for e in $(order "$run"); do
      case $e in pagedllm*) serve_pagedllm "$e" "$run" ;; *) "serve_$e" "$run" ;; esac
    done
  done
  for run in $(seq "$FIRST_RUN" "$RUNS"); do
    [[ ",$STEPS," == *,offline,* ]] || break
    for e in $(order "$run"); do
      case $e in pagedllm*) offline_pagedllm "$e" "$run" ;; vllm) offline_vllm "$run" ;; esac
    done
  done
  for run in $(seq "$FIRST_RUN" "$RUNS"); do
    [[ ",$STEPS," == *,prefix,* && -n "$PREFIX_ENGINE" ]] || break
    if (( run % 2 )); then prefix_run "$run" on; prefix_run "$run" off; else prefix_run "$run" off; prefix_run "$run" on; fi
  done
  record step=sweep_end date="$(date -Is)" load="$(loadavg)"
fi

"$PY" benchmarks/summarize_results.py "$OUT" --results-md "$RESULTS_MD"
if "$PY" -c "import matplotlib" 2>/dev/null; then
  "$PY" benchmarks/plot_results.py "$OUT" --output "$OUT/throughput_ttft.png"
  say "done: $RESULTS_MD, $OUT/throughput_ttft.png"
else  # scripts/setup.sh installs the test extra only
  say "done: $RESULTS_MD (no plot: matplotlib is missing; .venv/bin/pip install -e '.[bench]', then rerun with STEPS=report)"
fi
