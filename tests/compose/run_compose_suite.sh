#!/bin/bash
# `make test-compose`: the compose tests on this host (TCP data plane unless it has RDMA),
# then the same compose file with the RDMA override inside the soft-RoCE harness
# (tests/softroce/run_rdma_suite.sh: the qemu guest here). Prints each step's time.
#   KVBEAM_COMPOSE_GUEST=0   skip the RDMA run;  extra args go to the host pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
VENV=${VENV:-.venv}
TAR=.docker-cache/kvbeam-image.tar
mkdir -p .docker-cache
t0=$(date +%s)
save=$TAR
[ "${KVBEAM_COMPOSE_GUEST:-1}" = 0 ] && save=
KVBEAM_TEST_SAVE_IMAGE=$save "$VENV/bin/python" -m pytest -m compose tests/compose "$@"
t1=$(date +%s)
echo "test-compose: host run $((t1 - t0)) s"
if [ "${KVBEAM_COMPOSE_GUEST:-1}" = 0 ]; then
  echo "test-compose: RDMA run skipped (KVBEAM_COMPOSE_GUEST=0)"
  exit 0
fi
# The guest keeps dockerd's data (the loaded image) in RAM.
export KVBEAM_SOFTROCE_MEM=${KVBEAM_SOFTROCE_MEM:-6G}
bash tests/softroce/run_rdma_suite.sh --cmd \
  "bash tests/compose/guest_compose.sh $TAR -k moves_and_verifies"
t2=$(date +%s)
echo "test-compose: RDMA run (soft-RoCE harness) $((t2 - t1)) s; total $((t2 - t0)) s"
