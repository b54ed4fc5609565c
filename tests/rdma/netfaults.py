"""Network faults for the RDMA daemon tests: a wire between two rxe devices, cut on demand.

Both daemons sharing one rxe device talk through rxe's in-kernel loopback, which no
firewall or qdisc sees. So the fault tests give each daemon its own rxe device on one
end of a veth pair and force RoCE v2 traffic over that wire (the recipe in
``/work/shared/softroce/RECIPE.md``, measured there): both ends stay in the initial
namespace (the 6.1 rxe routes only there), get 10.10.0.1/2, and policy routing sends
locally generated packets for the peer's address out of the veth instead of through
``lo``. GID index 1 is the IPv4-mapped GID. The control plane stays on 127.0.0.1.

Faults, each with its healing twin: :func:`cut` drops every packet on both veth ends
(``tc netem loss 100%``; measured: the requester's retries run out in about 0.1 s,
IBV_WC_RETRY_EXC_ERR); :func:`firewall` drops UDP 4791 in the firewall (measured: rxe
never retries out, the QP stays RTS, only kvbeam's own deadline finds it);
:func:`port_down` takes prefill's netdev down (its rxe port goes DOWN and refuses to
send at once, IBV_WC_LOC_QP_OP_ERR); :func:`block_tcp` drops one TCP address:port (both
directions) in the firewall, e.g. the daemons' control ports on the wire's addresses (a
control-path partition that leaves 127.0.0.1 and RoCE alone).

This rewrites the routing rules of the machine it runs on, so it runs only in the
soft-RoCE guest (``KVBEAM_RDMA_MODE=vm``) unless ``KVBEAM_RDMA_NETFAULTS=1`` says the
host may be changed (rxe mode on a throw-away machine).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

A, B = "kvbA", "kvbB"  # veth ends (netdevs)
RXE_A, RXE_B = "rxeA", "rxeB"  # rxe devices on them: prefill on A, decode on B
IP_A, IP_B = "10.10.0.1", "10.10.0.2"
GID_INDEX = 1  # the IPv4-mapped RoCE v2 GID
_TABLE_A, _TABLE_B = "101", "102"


@dataclass(frozen=True)
class Wire:
    """The two rxe devices a fault test gives its daemons, and their netdevs' addresses."""

    prefill_device: str = RXE_A
    decode_device: str = RXE_B
    gid_index: int = GID_INDEX
    prefill_ip: str = IP_A
    decode_ip: str = IP_B

    def rdma_args(self, role: str) -> list[str]:
        """The daemon flags that put ``role`` on its end of the wire."""
        device = self.prefill_device if role == "prefill" else self.decode_device
        return ["--rdma-device", device, "--rdma-gid-index", str(self.gid_index)]


def sh(cmd: str, check: bool = True) -> str:
    """Run a shell command (as root in the guest); its stdout."""
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise RuntimeError(f"{cmd!r} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def allowed() -> str | None:
    """None when this machine's network may be rewired, else why not."""
    if os.environ.get("KVBEAM_RDMA_MODE") == "vm" or os.environ.get("KVBEAM_RDMA_NETFAULTS"):
        return None
    return ("the RDMA fault tests rewire routing (veth pair, policy rules) and run in the "
            "soft-RoCE guest (KVBEAM_RDMA_MODE=vm); set KVBEAM_RDMA_NETFAULTS=1 to allow "
            "them on this machine")


def _mac(dev: str) -> str:
    return Path(f"/sys/class/net/{dev}/address").read_text().strip()


def _routes() -> None:
    """Routes and neighbours that send each end's traffic over the wire (again after a
    link went down: the kernel flushes them with it)."""
    sh(f"ip route replace {IP_B} dev {A} src {IP_A} table {_TABLE_A}")
    sh(f"ip route replace {IP_A} dev {B} src {IP_B} table {_TABLE_B}")
    sh(f"ip neigh replace {IP_B} lladdr {_mac(B)} dev {A} nud permanent")
    sh(f"ip neigh replace {IP_A} lladdr {_mac(A)} dev {B} nud permanent")


def setup() -> Wire:
    """Create the veth pair, routing and the two rxe devices; idempotent."""
    if Path(f"/sys/class/infiniband/{RXE_B}").exists():
        return Wire()
    sh("modprobe veth; modprobe rdma_rxe; modprobe sch_netem")
    sh(f"ip link add {A} type veth peer name {B}")
    for dev, ip in ((A, IP_A), (B, IP_B)):
        sh(f"ip link set {dev} mtu 9000 up; ip addr add {ip}/24 dev {dev}")
        sh(f"sysctl -qw net.ipv4.conf.{dev}.rp_filter=0 net.ipv4.conf.{dev}.accept_local=1")
    sh("sysctl -qw net.ipv4.conf.all.rp_filter=0")
    _routes()
    # Locally generated packets for the peer's address go out of the veth, not via lo.
    sh(f"ip rule add pref 10 iif lo to {IP_B} lookup {_TABLE_A}")
    sh(f"ip rule add pref 11 iif lo to {IP_A} lookup {_TABLE_B}")
    sh("ip rule add pref 1000 lookup local; ip rule del pref 0")
    sh(f"rdma link add {RXE_A} type rxe netdev {A}; rdma link add {RXE_B} type rxe netdev {B}")
    wait_port(RXE_A)
    wait_port(RXE_B)
    return Wire()


def teardown() -> None:
    """Undo :func:`setup` (best effort)."""
    sh(f"rdma link delete {RXE_A}; rdma link delete {RXE_B}; ip link delete {A}", check=False)
    sh("ip rule add pref 0 lookup local; ip rule del pref 1000; ip rule del pref 10; "
       "ip rule del pref 11", check=False)


def wait_port(device: str, timeout: float = 20.0) -> None:
    """Wait until the rxe port is ACTIVE and its IPv4-mapped GID is back in its slot."""
    ip = IP_A if device == RXE_A else IP_B
    gid = "0000:0000:0000:0000:0000:ffff:" + "".join(
        f"{int(x):02x}" + (":" if i == 1 else "") for i, x in enumerate(ip.split(".")))
    port = f"/sys/class/infiniband/{device}/ports/1"
    sh(f"for _ in $(seq {int(timeout * 10)}); do grep -q ACTIVE {port}/state && "
       f"grep -qx {gid} {port}/gids/{GID_INDEX} && exit 0; sleep 0.1; done; exit 1")


def cut() -> None:
    """Silently drop every packet on both ends of the wire (a partition)."""
    sh(f"tc qdisc replace dev {A} root netem loss 100%; "
       f"tc qdisc replace dev {B} root netem loss 100%")


def heal() -> None:
    """Undo :func:`cut`."""
    sh(f"tc qdisc del dev {A} root; tc qdisc del dev {B} root", check=False)


def firewall() -> None:
    """Drop RoCE v2 (UDP 4791) in the firewall's OUTPUT chain: the sender's packets vanish
    with no error the QP sees, so only kvbeam's own deadline finds the partition."""
    sh("iptables -I OUTPUT -p udp --dport 4791 -j DROP")


def unfirewall() -> None:
    """Undo :func:`firewall`."""
    sh("iptables -D OUTPUT -p udp --dport 4791 -j DROP", check=False)


def _tcp_rules(ip: str, port: int) -> tuple[str, str]:
    # Both directions: packets to the port and replies from it (established connections).
    return (f"OUTPUT -p tcp -d {ip} --dport {port} -j DROP",
            f"OUTPUT -p tcp -s {ip} --sport {port} -j DROP")


def block_tcp(ip: str, port: int) -> None:
    """Drop TCP to and from ``ip:port`` in the firewall (no RST: connections just go silent)."""
    for rule in _tcp_rules(ip, port):
        sh(f"iptables -I {rule}")


def unblock_tcp(ip: str, port: int) -> None:
    """Undo :func:`block_tcp`."""
    for rule in _tcp_rules(ip, port):
        sh(f"iptables -D {rule}", check=False)


def port_down() -> None:
    """Take prefill's netdev down: its rxe port goes DOWN."""
    sh(f"ip link set {A} down")


def port_up() -> None:
    """Undo :func:`port_down`: link, routes and neighbours back, port ACTIVE."""
    sh(f"ip link set {A} up")
    _routes()
    wait_port(RXE_A)
    wait_port(RXE_B)  # the peer end lost its carrier with it


def qp_table() -> str:
    """``rdma resource show qp`` as printed (for messages)."""
    return sh("rdma resource show qp")


def qps(device: str) -> list[tuple[int, str]]:
    """(QP number, state) of every RC QP on an rxe device, from ``rdma resource``.

    By device, not by process: the pair's daemons each own one device (prefill rxeA,
    decode rxeB), and the extra daemons a test starts are dead when it counts.
    """
    found = []
    for line in qp_table().splitlines():
        words = line.split()
        fields = dict(zip(words[::2], words[1::2], strict=False))
        if fields.get("type") == "RC" and fields.get("link", "").split("/")[0] == device:
            found.append((int(fields["lqpn"]), fields.get("state", "?")))
    return found
