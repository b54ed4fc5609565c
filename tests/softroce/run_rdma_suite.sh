#!/bin/bash
# Entry point of `make test-rdma` (and, with --cmd, of `make bench`).
# Usage: run_rdma_suite.sh [pytest args...]      -> python -m pytest -m rdma [args] from the repo root
#        run_rdma_suite.sh --cmd 'shell command' -> that command, same environment
# Picks where RDMA runs, in this order, and says which:
#   1. device: an existing RDMA device (KVBEAM_RDMA_DEVICE, else the first `ibv_devices` lists)
#   2. rxe:    this kernel can `modprobe rdma_rxe`: rxe0 on a dummy netdev (removed afterwards)
#   3. vm:     neither (the usual case on CI here): one qemu guest boot (vmrun.sh) runs everything
# KVBEAM_RDMA_MODE=device|rxe|vm forces one. The command sees KVBEAM_RDMA_DEVICE,
# KVBEAM_RDMA_GID_INDEX (default 0), KVBEAM_RESULTS_DIR (a fresh writable dir that survives the
# guest; <cache>/results/latest points at it) and $VENV/bin first in PATH.
# Exits with the command's exit status; pytest's 5 (no tests collected) is reported as a failure.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${VENV:-$REPO/.venv}
DIR=${KVBEAM_SOFTROCE_DIR:-$REPO/.softroce}
MODE=${KVBEAM_RDMA_MODE:-auto}
GID_INDEX=${KVBEAM_RDMA_GID_INDEX:-0}
trap 'exit 130' INT    # exit through EXIT traps (rxe mode removes its device)
trap 'exit 143' TERM
say() { echo "rdma-suite: $*"; }
die() { echo "rdma-suite: ERROR: $*" >&2; exit 2; }

CMD=
if [ "${1:-}" = --cmd ]; then
  [ $# -eq 2 ] || die "usage: $0 --cmd 'shell command'"
  CMD=$2
  shift 2
fi
[ -x "$VENV/bin/python" ] || die "no venv at $VENV (make setup)"

# A fresh results dir inside the cache dir: the guest's only persistent writable place.
mkdir -p "$DIR/results"
{ ls -1dt "$DIR"/results/20* 2>/dev/null || true; } | tail -n +20 | xargs -r rm -rf
RESULTS=$(mktemp -d "$DIR/results/$(date +%Y%m%d-%H%M%S).XXXX")
ln -sfn "$RESULTS" "$DIR/results/latest"

first_ibv_device() { ibv_devices 2>/dev/null | awk 'NR > 2 && NF {print $1; exit}' || true; }

DEVICE=${KVBEAM_RDMA_DEVICE:-}
if [ "$MODE" = auto ]; then
  if [ -n "$DEVICE" ] || [ -n "$(first_ibv_device)" ]; then
    MODE=device
  elif modprobe rdma_rxe 2>/dev/null && command -v rdma >/dev/null; then
    MODE=rxe
  else
    MODE=vm
  fi
fi

case $MODE in
  device)
    DEVICE=${DEVICE:-$(first_ibv_device)}
    [ -n "$DEVICE" ] || die "KVBEAM_RDMA_MODE=device but ibv_devices lists no device"
    [ -e "/sys/class/infiniband/$DEVICE" ] || die "no RDMA device $DEVICE (/sys/class/infiniband)"
    say "mode device: using the existing RDMA device $DEVICE, gid index $GID_INDEX, on this host"
    ;;
  rxe)
    modprobe rdma_rxe || die "modprobe rdma_rxe failed"
    DEVICE=rxe0          # the same name as in the guest; none exists, or mode device was taken
    NETDEV=kvbeam-rxe
    say "mode rxe: this kernel has rdma_rxe; creating $DEVICE on dummy netdev $NETDEV (MTU 9000)"
    modprobe dummy 2>/dev/null || true
    cleanup() { rdma link delete "$DEVICE" 2>/dev/null || true; ip link delete "$NETDEV" 2>/dev/null || true; }
    cleanup
    trap cleanup EXIT
    ip link add "$NETDEV" type dummy
    ip link set "$NETDEV" mtu 9000 up        # MTU 9000 -> rxe active_mtu 4096
    rdma link add "$DEVICE" type rxe netdev "$NETDEV"
    ;;
  vm)
    DEVICE=rxe0   # created by guest/guest-init.sh
    GID_INDEX=0   # rxe on a dummy netdev: GID 0 is the RoCE v2 link-local GID
    say "mode vm: no RDMA device and no rdma_rxe on this kernel; booting the qemu soft-RoCE guest"
    # Idempotent (0.1 s when done): rebuilds the initramfs when its init script changed.
    bash "$HERE/setup.sh" >/dev/null || die "tests/softroce/setup.sh failed"
    ;;
  *) die "KVBEAM_RDMA_MODE must be auto, device, rxe or vm (got $MODE)";;
esac

# One script for all modes; in vm mode it runs inside the guest, where the repo is at the same
# path but read-only (writes go to a tmpfs and vanish), hence no pytest cache and results in
# $KVBEAM_RESULTS_DIR.
PYTEST=0
if [ -z "$CMD" ]; then
  PYTEST=1
  # Under TCG every import counts: collecting all of tests/ imports torch & co. (~75 s), so
  # without a path argument only tests/rdma/ is collected (~13 s); hypothesis' pytest plugin
  # adds ~14 s at startup and RDMA tests do not need it (@given works without the plugin).
  has_path=0
  for a in "$@"; do
    case $a in -*) ;; *) if [ -e "$REPO/${a%%::*}" ] || [ -e "${a%%::*}" ]; then has_path=1; fi;; esac
  done
  [ "$has_path" = 1 ] || set -- "$@" tests/rdma
  CMD="python -m pytest -m rdma -p no:cacheprovider ${KVBEAM_RDMA_PYTEST_OPTS--p no:hypothesispytest}"
  CMD+=" --junitxml=\"\$KVBEAM_RESULTS_DIR/junit.xml\"$(printf ' %q' "$@")"
fi
# Test knobs set here reach the command (the guest starts with a clean environment).
FORWARD=
while IFS='=' read -r name value; do
  FORWARD+="export $name=$(printf %q "$value")"$'\n'
done < <(env | grep -E '^KVBEAM_SOAK_[A-Z_]+=' || true)
SCRIPT="set -euo pipefail
${FORWARD}export KVBEAM_RDMA_DEVICE=$(printf %q "$DEVICE") KVBEAM_RDMA_GID_INDEX=$(printf %q "$GID_INDEX")
export KVBEAM_RESULTS_DIR=$(printf %q "$RESULTS") VIRTUAL_ENV=$(printf %q "$VENV") KVBEAM_RDMA_MODE=$(printf %q "$MODE")
export PATH=\"\$VIRTUAL_ENV/bin:\$PATH\" PYTHONUNBUFFERED=1
ulimit -l unlimited 2>/dev/null || echo 'rdma-suite: warning: cannot raise the memlock limit' >&2
cd $(printf %q "$REPO")
$CMD"

say "running: $CMD"
rc=0
if [ "$MODE" = vm ]; then
  bash "$HERE/vmrun.sh" "$SCRIPT" || rc=$?
else
  bash -c "$SCRIPT" || rc=$?
fi

# Figures tests leave behind (e.g. the soak's soak.json) go into the log: CI keeps only that.
for f in "$RESULTS"/*.json; do
  [ -f "$f" ] && say "$(basename "$f"): $(tr -s ' \n' ' ' < "$f")"
done
if [ "$rc" -eq 0 ]; then
  say "PASSED (mode $MODE; results in $RESULTS)"
elif [ "$PYTEST" = 1 ] && [ "$rc" -eq 5 ]; then
  say "FAILED: pytest collected no RDMA tests (exit 5); an empty RDMA suite is a failure"
else
  say "FAILED with exit status $rc (mode $MODE; results in $RESULTS)"
fi
exit "$rc"
