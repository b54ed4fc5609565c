#!/bin/bash
# The compose tests with the RDMA override (docker/compose.rdma.yaml), run by
# run_compose_suite.sh through tests/softroce/run_rdma_suite.sh --cmd. Inside the soft-RoCE
# guest (qemu, rdma_rxe, rxe0 on rxenet0) it first starts dockerd (data and exec roots on
# the guest's tmpfs; the host's docker.io through the guest's root) and loads the image the
# host built (docker save). On a host with an RDMA device or rdma_rxe, the tests start or
# use that host's engine and image instead.
# Usage: guest_compose.sh IMAGE_TAR [pytest args]
set -euo pipefail
IMAGE_TAR=${1:?usage: guest_compose.sh IMAGE_TAR [pytest args]}
shift
say() { echo "guest-compose: $(cut -d' ' -f1 /proc/uptime)s uptime: $*"; }

if grep -q 'softroce\.run=' /proc/cmdline 2>/dev/null; then
  say "in the soft-RoCE guest: starting dockerd"
  mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup
  modprobe -a overlay bridge br_netfilter veth nf_tables nft_compat nft_chain_nat \
    xt_MASQUERADE xt_addrtype xt_conntrack nf_nat
  ROOT=/tmp/docker
  mkdir -p "$ROOT"
  dockerd --data-root "$ROOT/data" --exec-root "$ROOT/exec" -p "$ROOT/dockerd.pid" \
    > "$ROOT/dockerd.log" 2>&1 &
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -30 "$ROOT/dockerd.log"; exit 1; }
  say "dockerd up; loading $IMAGE_TAR"
  docker load -q -i "$IMAGE_TAR"
  say "image loaded"
  export KVBEAM_TEST_SKIP_BUILD=1
  # Three processes import torch at once on 2 emulated CPUs: minutes, not seconds.
  export KVBEAM_HEALTH_START_PERIOD=${KVBEAM_HEALTH_START_PERIOD:-900s}
  export KVBEAM_HEALTH_INTERVAL=${KVBEAM_HEALTH_INTERVAL:-10s}
fi
export KVBEAM_COMPOSE_RDMA=1 KVBEAM_COMPOSE_SOFTROCE=${KVBEAM_COMPOSE_SOFTROCE:-rxenet0}
export KVBEAM_DOCKER_CACHE=${KVBEAM_RESULTS_DIR:-/tmp}/docker-cache
say "pytest"
python -m pytest -m compose tests/compose -p no:hypothesispytest "$@"
say "done"
