#!/usr/bin/env bash
# Disaggregated serving with the planner on a GPU machine: frontend, one prefill and one decode worker,
# and `python -m dynamo.planner` with its `local` connector, which starts and stops further workers on
# free GPUs of GPU_POOL (launch/worker_exec.sh takes one GPU per worker with a lock file).
#   MODEL=Qwen/Qwen3-0.6B GPU_POOL=0,1,2,3 PREFILL_MAX=2 DECODE_MAX=2 ./launch/disagg_planner.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
GPU_POOL="${GPU_POOL:-0,1,2,3}"
PREFILL_MIN="${PREFILL_MIN:-1}"
PREFILL_MAX="${PREFILL_MAX:-2}"
DECODE_MIN="${DECODE_MIN:-1}"
DECODE_MAX="${DECODE_MAX:-2}"
PLANNER_INTERVAL="${PLANNER_INTERVAL:-5}"
PLANNER_TARGET="${PLANNER_TARGET:-throughput}"
DECISION_LOG="${DECISION_LOG:-${LOG_DIR}/decisions.jsonl}"
export GPU_POOL GPU_LOCK_DIR="${GPU_LOCK_DIR:-${LOG_DIR}/gpu-locks}"

# The command of one worker of a pool, as one shell-quoted string (the planner's template).
worker_command() {
    local mode="$1"
    # shellcheck disable=SC2086
    printf '%q ' "$LAUNCH_DIR/worker_exec.sh" "$PYTHON" -m dynamo.vllm --model "$MODEL" \
        --disaggregation-mode "$mode" --namespace "$NAMESPACE" --kv-transfer-config "$KV_TRANSFER_CONFIG" \
        $WORKER_ARGS | sed -e 's/{/{{/g' -e 's/}/}}/g'  # the planner fills {placeholders}: escape braces
}

# The planner's configuration as JSON (built by Python: the worker commands need JSON string quoting).
PLANNER_CONFIG=$(
    NAMESPACE="$NAMESPACE" PLANNER_INTERVAL="$PLANNER_INTERVAL" PLANNER_TARGET="$PLANNER_TARGET" \
    PREFILL_MIN="$PREFILL_MIN" PREFILL_MAX="$PREFILL_MAX" DECODE_MIN="$DECODE_MIN" DECODE_MAX="$DECODE_MAX" \
    LOG_DIR="$LOG_DIR" PREFILL_CMD="$(worker_command prefill)" DECODE_CMD="$(worker_command decode)" \
    "$PYTHON" -c '
import json, os
e = os.environ
print(json.dumps({
    "namespace": e["NAMESPACE"], "interval_s": float(e["PLANNER_INTERVAL"]), "target": e["PLANNER_TARGET"],
    "prefill": {"min_replicas": int(e["PREFILL_MIN"]), "max_replicas": int(e["PREFILL_MAX"])},
    "decode": {"min_replicas": int(e["DECODE_MIN"]), "max_replicas": int(e["DECODE_MAX"])},
    "connector": "local",
    "local": {"prefill_command": e["PREFILL_CMD"].strip(), "decode_command": e["DECODE_CMD"].strip(),
              "log_dir": e["LOG_DIR"], "initial_prefill": 1, "initial_decode": 1},
}))'
)

start_nats
start_frontend
# The first replica of each pool, through the same GPU-picking wrapper as the planner's.
# shellcheck disable=SC2086
start worker-prefill "GPU_POOL=$GPU_POOL" -- "$LAUNCH_DIR/worker_exec.sh" "$PYTHON" -m dynamo.vllm --model "$MODEL" \
    --disaggregation-mode prefill --namespace "$NAMESPACE" --kv-transfer-config "$KV_TRANSFER_CONFIG" $WORKER_ARGS
# shellcheck disable=SC2086
start worker-decode "GPU_POOL=$GPU_POOL" -- "$LAUNCH_DIR/worker_exec.sh" "$PYTHON" -m dynamo.vllm --model "$MODEL" \
    --disaggregation-mode decode --namespace "$NAMESPACE" --kv-transfer-config "$KV_TRANSFER_CONFIG" $WORKER_ARGS
start planner -- "$PYTHON" -m dynamo.planner run --config "$PLANNER_CONFIG" --connector local \
    --namespace "$NAMESPACE" --decision-log "$DECISION_LOG" \
    --frontend-metrics-url "http://127.0.0.1:${HTTP_PORT}/metrics"
wait_any
