#!/usr/bin/env bash
# Run a worker command on the first free GPU of GPU_POOL, with its own NIXL side-channel port.
#   GPU_POOL=0,1,2,3 ./launch/worker_exec.sh python3 -m dynamo.vllm ...
# A GPU is taken by holding an flock on ${GPU_LOCK_DIR}/gpu<N>.lock for the worker's lifetime (the lock
# fd passes through exec), so a planner can start replicas from one fixed command template and each
# lands on a different GPU; the lock frees itself when the worker exits, however it exits.
set -euo pipefail
GPU_POOL="${GPU_POOL:-0,1,2,3,4,5,6,7}"
GPU_LOCK_DIR="${GPU_LOCK_DIR:-/tmp/dynamo-gpu-locks-$(id -u)}"
NIXL_PORT_BASE="${NIXL_PORT_BASE:-5600}"
if [[ $# -eq 0 ]]; then
    echo "usage: worker_exec.sh COMMAND [ARGS...]" >&2
    exit 2
fi
mkdir -p "$GPU_LOCK_DIR"
for gpu in ${GPU_POOL//,/ }; do
    exec {fd}>"$GPU_LOCK_DIR/gpu$gpu.lock"
    if flock -n "$fd"; then
        export CUDA_VISIBLE_DEVICES="$gpu"
        # Data-parallel ranks add their index to this port: leave room for 16 per GPU.
        export VLLM_NIXL_SIDE_CHANNEL_PORT="$((NIXL_PORT_BASE + 16 * gpu))"
        echo "[worker_exec] GPU $gpu, NIXL side channel port $VLLM_NIXL_SIDE_CHANNEL_PORT: $*" >&2
        exec "$@"
    fi
    exec {fd}>&-
done
echo "[worker_exec] no free GPU in GPU_POOL=$GPU_POOL (locks in $GPU_LOCK_DIR)" >&2
exit 75
