"""A control-path partition: the daemons cannot reach each other's gRPC, the scheduler can.

Each daemon listens on every address and advertises its end of the veth wire
(tests/rdma/netfaults.py) to its peer, so daemon-to-daemon calls (the Handshake RPC,
the peer channel's BeginWrite, Offer, Abort and heartbeats) go over the wire while this
test, the scheduler, calls both on 127.0.0.1. Dropping TCP to and from the two
advertised control ports and decode's channel port cuts only the daemons' path; RoCE
(UDP 4791) and the scheduler's calls still get through. A request in flight and a new
one must both end Failed on both sides, each by one of the mechanisms that notice a
partition (the peer channel's heartbeats, a call's deadline, a state's deadline: its
detail names which, with its configured seconds), decode's slots must all be free
again, and once the rules are gone the next request must succeed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from kvbeam.client import KvbeamClient, Status
from kvbeam.procs import DaemonProcess
from kvbeam.states import TransferState
from tests.control_helpers import free_port
from tests.daemon_helpers import DECODE_SLOTS, free_slots, start_both
from tests.rdma.netfaults import Wire, block_tcp, unblock_tcp
from tests.waiting import wait_until

pytestmark = pytest.mark.rdma
F, S = TransferState.FAILED, TransferState.SUCCESS
#: Deadlines of SLOW_GUEST (tests/daemon_helpers.py) that bound a partitioned request: the
#: longest state deadline (Bootstrapping and WaitingForInput, 20 s) plus one peer RPC
#: timing out (8 s), plus slack for the TCG guest (the scheduler's wait is thrice this).
BOUND_S = 20 + 8 + 15
#: How a daemon notices the partition, in the words of a failure's detail (its own, or
#: its peer's that it was told), each naming the seconds SLOW_GUEST configures: the peer
#: channel's heartbeats unanswered (1 s apart, 10 s peer timeout: "11 s allowed"), a call
#: to the peer past its deadline (8 s; the channel's expiry says "no answer in time"), or
#: a state's deadline (20 s; Transferring 10 s; prefill's wait for decode's Offer,
#: --send-wait-s, 10 s).
NOTICED = re.compile(
    r"peer stopped answering heartbeats on the peer channel \(silent [0-9.]+ s, 11 s allowed\)"
    r"|no answer within 8 s|on the peer channel to .*: no answer in time"
    r"|no progress in (Bootstrapping for 20|WaitingForInput for (20|10)|Transferring for 10)"
    r"\.0 s")


class AdvertisedPair(NamedTuple):
    """Daemons the scheduler reaches on loopback and each other on the wire."""

    prefill: DaemonProcess
    decode: DaemonProcess
    wire: Wire
    prefill_port: int
    decode_port: int
    channel_port: int  # decode's peer channel (prefill dials it on the wire)

    @property
    def prefill_peer(self) -> str:
        """Prefill's advertised control address: what decode dials."""
        return f"{self.wire.prefill_ip}:{self.prefill_port}"

    @property
    def decode_peer(self) -> str:
        """Decode's advertised control address: what prefill dials."""
        return f"{self.wire.decode_ip}:{self.decode_port}"

    def cut(self) -> None:
        """Drop the daemons' control traffic to each other, gRPC and the peer channel
        (the scheduler's still flows)."""
        block_tcp(self.wire.prefill_ip, self.prefill_port)
        block_tcp(self.wire.decode_ip, self.decode_port)
        block_tcp(self.wire.decode_ip, self.channel_port)

    def heal(self) -> None:
        """Undo :meth:`cut`."""
        unblock_tcp(self.wire.prefill_ip, self.prefill_port)
        unblock_tcp(self.wire.decode_ip, self.decode_port)
        unblock_tcp(self.wire.decode_ip, self.channel_port)


def _flags(wire: Wire, role: str, port: int) -> list[str]:
    ip = wire.prefill_ip if role == "prefill" else wire.decode_ip
    # Later flags override what start_both() passes: a wildcard --listen instead of loopback
    # (which needs --insecure: this guest is throw-away, nothing else reaches it), and no fill
    # pattern (filling the pools takes minutes under TCG; no byte is compared here).
    return [*wire.rdma_args(role), "--listen", f"0.0.0.0:{port}", "--advertise", f"{ip}:{port}",
            "--insecure", "--fill-seed", "-1"]


@pytest.fixture(scope="module")
def pair(wire: Wire) -> Iterator[AdvertisedPair]:
    pport, dport, cport = free_port(), free_port(), free_port()
    prefill, decode = start_both(transport="rdma",
                                 prefill_extra=_flags(wire, "prefill", pport),
                                 decode_extra=[*_flags(wire, "decode", dport),
                                               "--peer-port", str(cport)])
    ap = AdvertisedPair(prefill, decode, wire, pport, dport, cport)
    try:
        yield ap
    finally:
        ap.heal()
        prefill.stop()
        decode.stop()


def request(p: KvbeamClient, d: KvbeamClient, pair: AdvertisedPair, rid: str, seq_len: int,
            slot: int) -> Status:
    """One request end to end with the advertised peer addresses; decode's final status."""
    d.reserve(rid, seq_len, pair.prefill_peer)
    p.send(rid, slot, seq_len, pair.decode_peer)
    st = d.wait(rid, 120)
    if st.state is S:
        d.release(rid)
    return st


def _until_terminal(client: KvbeamClient, rid: str, t0: float) -> tuple[Status, float]:
    st = client.wait(rid, 3 * BOUND_S)
    return st, time.monotonic() - t0


def test_control_partition_fails_bounded_frees_all_and_heals(pair: AdvertisedPair) -> None:
    with KvbeamClient(f"127.0.0.1:{pair.prefill_port}") as p, \
            KvbeamClient(f"127.0.0.1:{pair.decode_port}") as d:
        warm = request(p, d, pair, "cp-warm", 2048, 0)
        assert warm.state is S, warm
        # The daemons know each other by their wire addresses, not loopback.
        assert f"at {pair.prefill_peer} verified" in pair.decode.output, \
            pair.decode.output[-4000:]
        # In flight: the first chunk landed; the rest will be sent into the partition.
        d.reserve("cp-inflight", 32768, pair.prefill_peer)
        p.send("cp-inflight", 1, 32768, pair.decode_peer, final=False, chunks=[(0, 8192)])
        assert wait_until(lambda: p.status("cp-inflight").bytes_done > 0, 60)
        pair.cut()
        try:
            t0 = time.monotonic()
            p.send("cp-inflight", 1, 32768, pair.decode_peer)
            # New: reserved and sent after the cut (the scheduler still reaches both).
            d.reserve("cp-new", 4096, pair.prefill_peer)
            p.send("cp-new", 2, 4096, pair.decode_peer)
            waits = [(c, side, rid) for rid in ("cp-inflight", "cp-new")
                     for c, side in ((p, "prefill"), (d, "decode"))]
            with ThreadPoolExecutor(max_workers=len(waits)) as pool:
                done = list(pool.map(lambda w: _until_terminal(w[0], w[2], t0), waits))
            for (_, side, rid), (st, secs) in zip(waits, done, strict=True):
                print(f"CONTROL PARTITION: {rid} {side} {st.state.value} "
                      f"reason={st.reason.value if st.reason else '-'} after {secs:.2f}s: "
                      f"{st.detail}")
            for (_, side, rid), (st, _secs) in zip(waits, done, strict=True):
                assert st.state is F, f"{rid} on {side} did not fail: {st}"
                # Ended by the partition's own mechanisms, not by another, longer deadline.
                assert NOTICED.search(st.detail), f"{rid} on {side}: {st}"
            # Nothing leaked: every decode slot is reservable again, still partitioned.
            assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 30), free_slots(d)
        finally:
            pair.heal()
        t_heal = time.monotonic()
        after = request(p, d, pair, "cp-after", 8192, 3)
        print(f"CONTROL PARTITION: next request {after.state.value} "
              f"{time.monotonic() - t_heal:.2f}s after the heal: {after.detail}")
        assert after.state is S, f"the first request after the heal failed: {after}"
        assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 30), free_slots(d)
