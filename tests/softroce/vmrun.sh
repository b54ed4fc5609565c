#!/bin/bash
# Usage: vmrun.sh 'shell command'
# Boots the soft-RoCE guest (qemu TCG, Debian's generic kernel, the host's / as a read-only
# overlay root; see README.md), runs the command there with bash (cwd: the run dir), streams its
# output and exits with its exit status.
# If the guest never reports an exit status (boot or setup failure, crash, timeout) it prints the
# guest console log and exits 125 (124 on timeout): never 0.
# Env: KVBEAM_SOFTROCE_DIR       cache dir (default <repo>/.softroce), made by setup.sh
#      KVBEAM_SOFTROCE_TIMEOUT   whole run, seconds (default 2700)
#      KVBEAM_SOFTROCE_BOOT_TIMEOUT  until rxe0 is up (default 300; a boot takes 10-40 s)
#      KVBEAM_SOFTROCE_MEM, _SMP guest size (default 3G: two torch processes + pools fit; 2 vCPUs)
#      KVBEAM_SOFTROCE_DEBUG=1   all kernel messages and a trace of the init scripts on the console
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
DIR=${KVBEAM_SOFTROCE_DIR:-$REPO/.softroce}
TIMEOUT=${KVBEAM_SOFTROCE_TIMEOUT:-2700}
BOOT_TIMEOUT=${KVBEAM_SOFTROCE_BOOT_TIMEOUT:-300}
MEM=${KVBEAM_SOFTROCE_MEM:-3G}
SMP=${KVBEAM_SOFTROCE_SMP:-2}

[ $# -eq 1 ] || { echo "usage: $0 'shell command'" >&2; exit 2; }
KVER=$(cat "$DIR/kroot/KVER" 2>/dev/null) && [ -f "$DIR/initramfs.cpio.gz" ] \
  || { echo "vmrun: no guest kernel/initramfs in $DIR; run tests/softroce/setup.sh (make setup)" >&2; exit 2; }

case "$DIR$HERE" in *[[:space:]]*)   # both travel on the kernel command line
  echo "vmrun: the cache dir and repo paths must not contain spaces" >&2; exit 2;; esac

# On INT/TERM exit via the EXIT trap below, which stops qemu. Waits run as `cmd & wait $!`,
# which a signal interrupts at once (bash defers traps while a foreground child runs).
trap 'exit 130' INT
trap 'exit 143' TERM

# Two guests on this 2-core machine would each crawl; queue behind any other one.
exec 9> "${TMPDIR:-/tmp}/kvbeam-softroce-vm.lock"
if ! flock -n 9; then
  echo "vmrun: another soft-RoCE guest is running; waiting for it"
  flock 9 & wait $!
fi

# One dir per run on the work share: cmd in; out, rc, ready, uptime, console.log back.
mkdir -p "$DIR/runs"
{ ls -1dt "$DIR"/runs/run.* 2>/dev/null || true; } | tail -n +10 | xargs -r rm -rf  # keep 10
RUN=$(mktemp -d "$DIR/runs/run.XXXXXX")
printf '%s\n' "$1" > "$RUN/cmd"

# quiet: the serial console is slow under TCG; loglevel=4 still shows kernel errors.
KARGS="console=ttyS0 panic=-1"
if [ "${KVBEAM_SOFTROCE_DEBUG:-0}" = 1 ]; then KARGS+=" softroce.debug=1"; else KARGS+=" quiet loglevel=4"; fi
KARGS+=" softroce.work=$DIR softroce.run=$RUN softroce.init=$HERE/guest/guest-init.sh"
KARGS+=" softroce.repo=$REPO"

echo "vmrun: booting guest (qemu TCG, -smp $SMP -m $MEM, kernel $KVER; run dir $RUN)"
start=$SECONDS
# thread=multi: one host thread per vCPU. -no-reboot + panic=-1: a guest crash ends qemu at once.
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 \
  -accel tcg,thread=multi -cpu max -M q35 -smp "$SMP" -m "$MEM" \
  -nodefaults -no-user-config -display none -no-reboot -monitor none -nic none \
  -serial "file:$RUN/console.log" \
  -kernel "$DIR/kroot/boot/vmlinux-$KVER" -initrd "$DIR/initramfs.cpio.gz" -append "$KARGS" \
  -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
  -virtfs "local,path=$DIR,mount_tag=work,security_model=none,multidevs=remap" \
  -virtfs "local,path=$REPO,mount_tag=repo,security_model=none,readonly=on,multidevs=remap" \
  > "$RUN/qemu.log" 2>&1 &
qpid=$!
trap 'kill "$qpid" 2>/dev/null || true' EXIT   # also on Ctrl-C: background jobs ignore SIGINT

sent=0 ready='' boot_failed='' note=$((start + 15))
pump() {   # print what the guest command wrote since the last call
  local size
  size=$(stat -c %s "$RUN/out" 2>/dev/null || echo 0)
  if [ "$size" -gt "$sent" ]; then
    tail -c +$((sent + 1)) "$RUN/out" | head -c $((size - sent))
    sent=$size
  fi
}
check_ready() {
  if [ -z "$ready" ] && [ -s "$RUN/ready" ]; then
    ready=1
    echo "vmrun: after $((SECONDS - start)) s, $(cat "$RUN/ready")"
  fi
}
while kill -0 "$qpid" 2>/dev/null; do
  check_ready
  if [ -z "$ready" ] && [ $((SECONDS - start)) -ge "$BOOT_TIMEOUT" ]; then
    echo "vmrun: guest not up after $BOOT_TIMEOUT s (KVBEAM_SOFTROCE_BOOT_TIMEOUT); stopping it" >&2
    boot_failed=1
    kill "$qpid"
  elif [ -z "$ready" ] && [ "$SECONDS" -ge "$note" ]; then
    echo "vmrun: still booting ($((SECONDS - start)) s)"
    note=$((SECONDS + 15))
  fi
  pump
  sleep 1 & wait $!
done
qrc=0
wait "$qpid" || qrc=$?
trap - EXIT
check_ready
pump

if [ -f "$RUN/rc" ]; then
  rc=$(cat "$RUN/rc")
  echo "vmrun: guest command exited $rc after $((SECONDS - start)) s" \
       "(guest uptime at end, at ready: $(cat "$RUN/uptime"))"
  exit "$rc"
fi
timed_out=
if [ -z "$boot_failed" ] && { [ "$qrc" -eq 124 ] || [ "$qrc" -eq 137 ]; }; then timed_out=1; fi
{
  if [ -n "$boot_failed" ]; then
    echo "vmrun: FAILED: guest did not boot within $BOOT_TIMEOUT s"
  elif [ -n "$timed_out" ]; then
    echo "vmrun: TIMEOUT: guest did not finish within $TIMEOUT s (KVBEAM_SOFTROCE_TIMEOUT)"
  else
    echo "vmrun: FAILED: guest ended without an exit status (qemu exit $qrc)"
  fi
  echo "----- guest console ($RUN/console.log) -----"
  cat "$RUN/console.log" 2>/dev/null || true
  echo "----- qemu ($RUN/qemu.log) -----"
  cat "$RUN/qemu.log" 2>/dev/null || true
  echo "-----"
  echo "vmrun: for all kernel messages and a trace of the guest's init: KVBEAM_SOFTROCE_DEBUG=1"
} >&2
if [ -n "$timed_out" ]; then exit 124; fi
exit 125
