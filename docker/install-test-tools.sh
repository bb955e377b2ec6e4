#!/usr/bin/env bash
# Installs what the slow suites (make test-stack, make test-image) need and `make test` does not:
# Debian's prometheus/promtool, chromium, podman/buildah/runc/mmdebstrap/catatonit (compose's
# `init: true`); playwright and podman-compose from PyPI;
# the dashboard validator's npm packages. Needs root for apt-get (CI runs as root).
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for tool in prometheus:prometheus promtool:prometheus chromium:chromium podman:podman buildah:buildah \
            runc:runc mmdebstrap:mmdebstrap catatonit:catatonit node:nodejs npm:npm; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
if ((${#need[@]})); then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" uidmap fuse-overlayfs slirp4netns >/dev/null
fi
.venv/bin/python -m pip install --quiet -e '.[stack]'
