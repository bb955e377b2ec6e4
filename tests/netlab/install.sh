#!/usr/bin/env bash
# Installs what the network lab (tests/netlab) needs and `make test` does not: iproute2 and iptables
# from Debian, and the delayer's NetfilterQueue (built against libnetfilter-queue-dev) into the venv.
# Needs root, as the lab itself does.
set -euo pipefail
cd "$(dirname "$0")/../.."
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v iptables >/dev/null || need+=(iptables)
[[ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ]] || need+=(libnetfilter-queue-dev)
command -v cc >/dev/null || need+=(build-essential)
if ((${#need[@]})); then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" python3-dev >/dev/null
fi
.venv/bin/python -m pip install --quiet 'NetfilterQueue==1.1.0'
