#!/usr/bin/env bash
# Aggregated serving on a GPU machine: frontend + one dynamo.vllm worker (prefill and decode in one engine).
#   MODEL=Qwen/Qwen3-0.6B AGG_GPUS=0 ./launch/agg.sh      (settings: launch/common.sh, docs/gpu-and-kubernetes.md)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
AGG_GPUS="${AGG_GPUS:-0}"

start_nats
start_frontend
start_worker worker-agg agg "$AGG_GPUS" 5600
wait_any
