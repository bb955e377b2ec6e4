#!/usr/bin/env bash
# Builds the volunteer image on a machine with no registry and no Docker daemon, then runs
# tests/image (a container joins a swarm started on the host). Used by `make test-image`.
#
# Everything specific to such a machine lives here, not in the Dockerfile users build:
#  - podman needs the runc runtime and explicit ulimits (crun fails on this kernel's cgroups);
#  - the base image `python:3.11-slim` cannot be pulled, so a Debian root filesystem made with
#    mmdebstrap is imported under that name;
#  - podman writes OCI images by default, which have no HEALTHCHECK: it builds in Docker's format;
#  - pip inside the build trusts the host's CA bundle and takes torch from the host's local wheel
#    directory (PIP_FIND_LINKS), so it gets the CPU build instead of PyPI's CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${SWARM_TEST_IMAGE:-localhost/swarm-peer:test}
BASE=docker.io/library/python:3.11-slim
WORK=build/image-test
mkdir -p "$WORK"

cat > "$WORK/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF="$PWD/$WORK/containers.conf"

if ! podman image exists "$BASE"; then
  echo "making the base image $BASE with mmdebstrap (no registry here)"
  rm -f "$WORK/rootfs.tar"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs.tar"
  podman import --quiet "$WORK/rootfs.tar" "$BASE" >/dev/null
  rm -f "$WORK/rootfs.tar"
fi

# pip in the build: the host's CA bundle and its local wheels (torch's CPU build lies there).
ca=$(.venv/bin/python -m pip config get global.cert 2>/dev/null || echo /etc/ssl/certs/ca-certificates.crt)
wheels=$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)
printf '[global]\ncert = /etc/ssl/host-ca.crt\n' > "$WORK/pip.conf"
mounts=(-v "$ca:/etc/ssl/host-ca.crt:ro" -v "$PWD/$WORK/pip.conf:/etc/pip.conf:ro")
args=()
if [ -n "$wheels" ]; then  # torch's CPU wheel is there: take it, and the rest from PyPI
  mounts+=(-v "$wheels:/wheels:ro")
  args+=(--build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
fi
echo "building $IMAGE"
start=$(date +%s)
podman build --quiet --format docker --network=host "${mounts[@]}" ${args[@]+"${args[@]}"} -f docker/Dockerfile -t "$IMAGE" . >/dev/null
echo "built $IMAGE in $(( $(date +%s) - start )) s: $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

SWARM_TEST_IMAGE=$IMAGE .venv/bin/python -m pytest -q tests/image "$@"
