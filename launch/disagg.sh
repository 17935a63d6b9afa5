#!/usr/bin/env bash
# Disaggregated serving on a GPU machine: frontend + one prefill and one decode dynamo.vllm worker, KV moved
# by vLLM's NixlConnector; one GPU per worker.
#   MODEL=Qwen/Qwen3-0.6B PREFILL_GPUS=0 DECODE_GPUS=1 ./launch/disagg.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PREFILL_GPUS="${PREFILL_GPUS:-0}"
DECODE_GPUS="${DECODE_GPUS:-1}"

start_nats
start_frontend
start_worker worker-prefill prefill "$PREFILL_GPUS" 5600
start_worker worker-decode decode "$DECODE_GPUS" 5601
wait_any
