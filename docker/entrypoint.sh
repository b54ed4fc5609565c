#!/bin/sh
# kvbeam container entrypoint: optional soft-RoCE set-up, RDMA diagnostics, then
# `kvbeam "$@"` (as KVBEAM_RUN_AS when started as root).
#
#   KVBEAM_SOFTROCE=IFACE  create a soft-RoCE (rdma_rxe) device on IFACE, or reuse the one
#                          already there, and point KVBEAM_RDMA_DEVICE at it; when that is
#                          impossible say exactly why (the daemon then falls back to TCP
#                          with --transport auto, or refuses to start with --transport rdma)
#   KVBEAM_RUN_AS=USER     the user to run kvbeam as after the root-only set-up (default
#                          kvbeam; "root" keeps root)
set -eu

say() { echo "kvbeam-entrypoint: $*" >&2; }

# Print the rxe device already bound to netdev $1, if any.
rxe_on() {
    rdma link show 2>/dev/null | awk -v want="$1" '
        { for (i = 1; i < NF; i++) if ($i == "netdev" && $(i + 1) == want) { split($2, a, "/"); print a[1]; exit } }'
}

softroce() {
    iface=$1
    if ! command -v rdma >/dev/null 2>&1; then
        say "soft-RoCE unavailable: the 'rdma' tool (iproute2) is missing from this image"
        return 1
    fi
    if [ ! -e "/sys/class/net/$iface" ]; then
        say "soft-RoCE unavailable: KVBEAM_SOFTROCE=$iface: no network interface $iface in this" \
            "container (have: $(ls /sys/class/net | tr '\n' ' '))"
        return 1
    fi
    dev=$(rxe_on "$iface")
    if [ -n "$dev" ]; then
        say "soft-RoCE: $dev already runs on $iface: using it"
    else
        if [ ! -d /sys/module/rdma_rxe ]; then
            say "soft-RoCE unavailable: kernel $(uname -r) has no rdma_rxe module loaded; a" \
                "container cannot load modules: on the host run 'modprobe rdma_rxe' (kernels" \
                "without CONFIG_RDMA_RXE, e.g. Debian's cloud kernels, cannot do soft-RoCE)"
            return 1
        fi
        dev=${KVBEAM_SOFTROCE_NAME:-rxe_$iface}
        if ! out=$(rdma link add "$dev" type rxe netdev "$iface" 2>&1); then
            say "soft-RoCE unavailable: 'rdma link add $dev type rxe netdev $iface' failed: $out" \
                "(it needs root and CAP_NET_ADMIN in the container: user: root plus cap_add" \
                "NET_ADMIN, or privileged)"
            return 1
        fi
        say "soft-RoCE: created $dev on $iface"
    fi
    export KVBEAM_RDMA_DEVICE="${KVBEAM_RDMA_DEVICE:-$dev}"
}

# Explain what stops RDMA, without failing: the daemon decides (auto -> TCP, rdma -> refuse).
rdma_diagnostics() {
    transport=${KVBEAM_TRANSPORT:-auto}
    [ "$transport" = tcp ] && return 0
    if [ "$transport" = rdma ]; then
        outcome="the daemon will refuse to start (KVBEAM_TRANSPORT=rdma)"
    else
        outcome="the data plane will be TCP"
    fi
    devices=$(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')
    if [ -z "$devices" ]; then
        say "no RDMA device visible (/sys/class/infiniband is empty): $outcome"
        return 0
    fi
    if ! ls /dev/infiniband/uverbs* >/dev/null 2>&1; then
        say "RDMA devices $devices exist but /dev/infiniband/uverbs* is missing: pass" \
            "--device /dev/infiniband/uverbsN (compose: devices:); otherwise $outcome"
        return 0
    fi
    limit=$(ulimit -l)
    if [ "$limit" != unlimited ]; then
        say "memlock limit is $limit KiB: registering the pools for RDMA will fail; run with" \
            "--ulimit memlock=-1 (compose: ulimits: memlock: -1)"
    fi
}

if [ -n "${KVBEAM_SOFTROCE:-}" ]; then
    softroce "$KVBEAM_SOFTROCE" || true
fi
rdma_diagnostics

run_as=${KVBEAM_RUN_AS:-kvbeam}
if [ "$(id -u)" = 0 ] && [ "$run_as" != root ]; then
    # The device nodes docker creates keep the host's mode (often 0600 root): let the
    # unprivileged user open them. This changes only the container's own /dev.
    for node in /dev/infiniband/uverbs* /dev/infiniband/rdma_cm; do
        [ -e "$node" ] && chmod 0666 "$node" 2>/dev/null || true
    done
    exec setpriv --reuid="$run_as" --regid="$run_as" --init-groups -- kvbeam "$@"
fi
exec kvbeam "$@"
