#!/usr/bin/env bash
# A model family in a real model's shape (random weights, benchmarks/shaped_model.py) served by pagedllm and by
# vLLM's CPU build from the same folder, in one sitting: compare_vllm.sh's serving and offline workloads.
#
#   benchmarks/family_vs_vllm.sh                     # qwen3-0.6b, RUNS=3, c1 and c16, offline
#   SHAPE=qwen3-0.6b RUNS=3 WORKLOADS="1:16 16:64" PAGEDLLM_MODEL=/tmp/q.gguf benchmarks/family_vs_vllm.sh
#
# compare_vllm.sh serves peers.sh's model folder with vLLM; here that folder is the shaped model, through a
# PEERS_DIR of its own ($FAMILY_PEERS_DIR) that links to peers.sh's vLLM venv (`peers.sh setup` first). pagedllm
# serves PAGEDLLM_MODEL (default: the same folder; a GGUF of it for the quantized comparison). Results go to
# OUT (default /tmp/pagedllm-family-SHAPE) with their tables in $OUT/RESULTS.md; copy the figures into
# benchmarks/RESULTS.md with the CPU and the load.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHAPE=${SHAPE:-qwen3-0.6b}
MODEL=${MODEL:-/tmp/pagedllm-shaped-$SHAPE}
PEERS_VENV=${PEERS_VENV:-/tmp/pagedllm-peers/venv}
FAMILY_PEERS_DIR=${FAMILY_PEERS_DIR:-/tmp/pagedllm-peers-$SHAPE}
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PEERS_VENV/bin/vllm" ] || { echo "no vLLM in $PEERS_VENV: run ../shared/bench/peers.sh setup first" >&2; exit 2; }
[ -f "$MODEL/config.json" ] || "$PY" "$ROOT/benchmarks/shaped_model.py" "$SHAPE" "$MODEL"
mkdir -p "$FAMILY_PEERS_DIR/models" "$FAMILY_PEERS_DIR/logs" "$FAMILY_PEERS_DIR/results"
ln -sfn "$PEERS_VENV" "$FAMILY_PEERS_DIR/venv"
ln -sfn "$MODEL" "$FAMILY_PEERS_DIR/models/smollm2-135m-instruct"  # the folder peers.sh serves and tokenizes with
PEERS_DIR=$FAMILY_PEERS_DIR ENGINES=${ENGINES:-"vllm pagedllm"} RUNS=${RUNS:-3} STEPS=${STEPS:-serve,offline} \
  WORKLOADS=${WORKLOADS:-"1:16 16:64"} OUT=${OUT:-/tmp/pagedllm-family-$SHAPE} \
  PAGEDLLM_ARGS="--model ${PAGEDLLM_MODEL:-$MODEL} --dtype auto --max-model-len 2048 ${PAGEDLLM_EXTRA_ARGS:-}" \
  exec "$ROOT/benchmarks/compare_vllm.sh"
