#!/bin/bash
# PID 1 of the soft-RoCE guest, started by initramfs-init via switch_root; runs from the host's
# repo through the overlay root, so edits here need no initramfs rebuild.
# Sets up what the tests expect (/dev/shm, loopback, memlock, rxe0 on a dummy netdev with
# MTU 9000; /tmp and /run are fresh tmpfs from initramfs-init), runs $RUN/cmd once, writes its output to $RUN/out and its exit status to $RUN/rc
# (both on the read-write work share), then powers off. On any setup failure it powers off
# WITHOUT writing $RUN/rc, which the host reports as a boot failure along with the console log.
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 TERM=dumb TMPDIR=/tmp

poweroff_now() { sync; echo o > /proc/sysrq-trigger; sleep 30; }
fail() { echo "guest-init: FAILED: $*" > /dev/console; poweroff_now; }
trap 'fail "line $LINENO: $BASH_COMMAND"' ERR
arg() { sed -n "s/.*softroce\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }

if [ "$(arg debug)" = 1 ]; then    # KVBEAM_SOFTROCE_DEBUG=1: trace each step with its uptime
  PS4='+ $(cut -d" " -f1 /proc/uptime) '
  set -x
fi
WORK=$(arg work)
RUN=$(arg run)
[ -f "$RUN/cmd" ] || fail "no command file $RUN/cmd"

mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t devpts devpts /dev/pts
hostname softroce-guest
ip link set lo up

# Kernel modules come from the unpacked Debian kernel in the cache dir.
KVER=$(uname -r)
mkdir -p /lib/modules
ln -sfn "$WORK/kroot/lib/modules/$KVER" "/lib/modules/$KVER"
modprobe rdma_rxe
modprobe dummy numdummies=0
# MTU 9000 makes the rxe port's active_mtu 4096 (with 1500 it would be 1024).
ip link add rxenet0 type dummy
ip link set rxenet0 mtu 9000 up
rdma link add rxe0 type rxe netdev rxenet0
# The port goes ACTIVE asynchronously once the netdev is up; wait for it briefly.
for _ in $(seq 50); do
  grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state && break
  sleep 0.1
done
grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state || fail "rxe0 port not ACTIVE"
ulimit -l unlimited                  # RDMA memory registration pins pages

ready=$(uptime_s)
echo "guest ready at uptime ${ready}s: rxe0 on rxenet0, $(ibv_devinfo -d rxe0 | grep -o 'active_mtu:.*' | tr -s '\t ' ' '), gid0 $(cat /sys/class/infiniband/rxe0/ports/1/gids/0)" \
  > "$RUN/ready"

rc=0
({ set +x; } 2>/dev/null; cd "$RUN" && exec bash "$RUN/cmd") > "$RUN/out" 2>&1 < /dev/null || rc=$?
echo "$(uptime_s) $ready" > "$RUN/uptime"
echo "$rc" > "$RUN/rc"
echo "guest-init: command exited $rc; powering off" > /dev/console
poweroff_now
