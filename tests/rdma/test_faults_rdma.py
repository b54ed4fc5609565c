"""Faults over RDMA: partitions, a QP in the error state, SIGKILL during the handshake.

The daemons run on two rxe devices joined by a veth wire (tests/rdma/netfaults.py), so
a fault can cut the data path while the control plane (gRPC on 127.0.0.1) stays up.
Every test checks the same three things: both sides reach Failed by the mechanism that
notices the fault (the failure's reason and detail say which: a verbs status, the
transport's own write deadline or a state's deadline with its configured seconds, the
peer's loss; each detection's time is printed, not asserted: a cut wire fails each of
prefill's attempts, the first and its resends on new QPs), nothing leaks (decode's
slots all reservable again, no request left live, no QP left behind: ``rdma resource``
lists exactly one QP per daemon and peer), and service continues (the next request
succeeds over a freshly built QP).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest

from kvbeam.client import KvbeamClient, Status
from kvbeam.scheduler import drive, run_request
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import DECODE_SLOTS, STARTUP_S, free_slots, spawn
from tests.rdma import netfaults
from tests.rdma.conftest import WirePair
from tests.waiting import wait_until

pytestmark = pytest.mark.rdma
F, S = TransferState.FAILED, TransferState.SUCCESS
#: Verbs statuses, kvbeam's own deadline (TIMEOUT) or a QP state: what a data-path
#: failure must name in its detail.
VERBS_STATUS = re.compile(r"IBV_WC_[A-Z_]+|IBV_QPS_[A-Z]+|TIMEOUT")
#: The transport's own write deadline in these daemons (server/runtime.py: 0.8 x the
#: 10 s Transferring deadline of SLOW_GUEST), as its detail names it: "no completion
#: within 8 s with N WRs outstanding".
OP_TIMEOUT_S = 0.8 * 10
#: The state deadlines of SLOW_GUEST, as a request that one of them ended names it
#: (server/state/lifecycle.py: the state's configured budget, even where a large request's
#: bytes extended it): "no progress in Bootstrapping for 20.0 s".
STATE_DEADLINE = re.compile(r"^no progress in (Bootstrapping for 20|WaitingForInput for 20"
                            r"|Transferring for 10)\.0 s")
#: A peer channel that its peer's process closed (EOF or a reset on its socket, at once),
#: as the channel's log line and a failure's detail name it (server/peers/channel.py),
#: unlike one whose peer fell silent ("peer stopped answering heartbeats").
CHANNEL_EOF = re.compile(r"(closed|lost): (the peer closed the connection|receive failed: "
                         r"|send failed: )")


@pytest.fixture
def clients(wire_pair: WirePair) -> Iterator[tuple[KvbeamClient, KvbeamClient]]:
    with KvbeamClient(wire_pair.prefill.address) as p, \
            KvbeamClient(wire_pair.decode.address) as d:
        yield p, d


def one_qp_each(pair: WirePair) -> tuple[int, int]:
    """Wait until each daemon's device holds exactly one QP, in RTS; (prefill's, decode's).

    A QP more is a leak: every failed link must have been destroyed, and the QP of a
    replaced link too.
    """
    def check() -> bool:
        return all(len(q) == 1 and q[0][1] == "RTS" for q in (
            netfaults.qps(pair.wire.prefill_device), netfaults.qps(pair.wire.decode_device)))

    ok = wait_until(check, 20, interval=0.5)
    p, d = netfaults.qps(pair.wire.prefill_device), netfaults.qps(pair.wire.decode_device)
    assert ok, f"QPs: prefill {p}, decode {d}:\n{netfaults.qp_table()}"
    return p[0][0], d[0][0]


def _wait(client: KvbeamClient, rid: str, t0: float) -> tuple[Status, float]:
    st = client.wait(rid, 90)
    return st, time.monotonic() - t0


def own_deadline(st: Status) -> bool:
    """Whether ``st`` ended by one of the state deadlines these daemons are configured
    with, naming its configured seconds."""
    return st.reason is FailureReason.TIMEOUT and STATE_DEADLINE.search(st.detail) is not None


def told_by_prefill(st: Status) -> bool:
    """Whether decode's ``st`` is prefill's word on the request (its Abort), not decode's
    own deadline."""
    return st.reason is FailureReason.PEER_FAILED and st.detail.startswith("prefill failed: ")


def report(what: str, side: str, st: Status, seconds: float) -> None:
    """One line per detection, for the issue's table (pytest -s or the junit output)."""
    print(f"FAULT {what}: {side} {st.state.value} reason={st.reason.value if st.reason else '-'}"
          f" after {seconds:.2f}s: {st.detail}")


CUTS: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
    "netem-loss": (netfaults.cut, netfaults.heal),
    "firewall-drop": (netfaults.firewall, netfaults.unfirewall),
    "port-down": (netfaults.port_down, netfaults.port_up),
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_partition_mid_request_fails_bounded_then_heals(
        wire_pair: WirePair, clients: tuple[KvbeamClient, KvbeamClient], cut: str) -> None:
    pair = wire_pair
    p, d = clients
    paddr, daddr = pair.prefill.address, pair.decode.address
    assert run_request(p, d, f"{cut}-warm", 2048, 0, timeout=120).ok
    qp_before = one_qp_each(pair)
    # The first chunk lands; the data path is cut; the final chunk is posted into it.
    rid = f"{cut}-victim"
    d.reserve(rid, 32768, paddr)
    p.send(rid, 1, 32768, daddr, final=False, chunks=[(0, 8192)])
    assert wait_until(lambda: p.status(rid).bytes_done > 0, 60)
    do, undo = CUTS[cut]
    do()
    try:
        t0 = time.monotonic()
        p.send(rid, 1, 32768, daddr)
        pst, tp = _wait(p, rid, t0)
        dst, td = _wait(d, rid, t0)
        report(cut, "prefill", pst, tp)
        report(cut, "decode", dst, td)
        print("\n".join(ln for ln in pair.prefill.output.splitlines()
                        if f"{rid}: resend" in ln or (" failed: " in ln and rid in ln)))
        # Each attempt ends by the transport's error, named in the detail with the
        # resends tried; a resend the request's deadline would cut is not started (the
        # detail says "no time left to resend"), so the deadline never hides the status.
        assert pst.state is F and pst.reason in (FailureReason.TRANSPORT_ERROR,
                                                 FailureReason.PEER_FAILED), pst
        assert VERBS_STATUS.search(pst.detail) and "resend" in pst.detail, pst
        assert dst.state is F and dst.reason in (FailureReason.PEER_FAILED,
                                                 FailureReason.TIMEOUT), dst
        # The wire stays cut: each resend fails too, each attempt as the first did.
        assert (f"request {rid}: resend 1/2" in pair.prefill.output
                or "no time left to resend" in pst.detail), pst
        # Each attempt ended by the data path's own failure: a work completion's status
        # from the device, or the transport's own write deadline naming its configured
        # seconds; not prefill's state deadline (TIMEOUT, "no progress in ..."), ruled
        # out above, nor another, longer one.
        assert set(re.findall(r"no completion within (\S+) s", pst.detail)) <= {
            f"{OP_TIMEOUT_S:g}"}, pst
        # Decode heard it from prefill (its Abort, once the resends were spent), or its own
        # Transferring deadline, the configured one, came first.
        assert told_by_prefill(dst) or own_deadline(dst), dst
        # Reserved during the partition, sent after it: the new handshake that the send
        # triggers must not fail it along with the old link.
        d.reserve(f"{cut}-bystander", 4096, paddr)
    finally:
        undo()
    # Healed: the bystander's send handshakes a new QP pair and succeeds, and so do others.
    assert finish(p, d, f"{cut}-bystander", 4096, 2).state is S
    assert run_request(p, d, f"{cut}-after", 8192, 3, timeout=120).ok
    qp_after = one_qp_each(pair)
    assert qp_after[0] != qp_before[0] and qp_after[1] != qp_before[1], (qp_before, qp_after)
    assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 30)


def finish(p: KvbeamClient, d: KvbeamClient, rid: str, seq_len: int, slot: int) -> Status:
    """Send a request decode already reserved; its decode status (released on Success)."""
    p.send(rid, slot, seq_len, d.address)
    st = d.wait(rid, 120)
    if st.state is S:
        d.release(rid)
    return st


def _lines_of(pair: WirePair, rid: str) -> dict[str, list[str]]:
    """Each daemon's log lines naming ``rid``, a link or QP, an abort, or a failed
    background job (a failure's context)."""
    keys = (rid, "link", "QP", "qp", "bort", "background job", "Traceback", "Error")
    return {d.role: [line for line in d.lines if any(k in line for k in keys)][-80:]
            for d in (pair.prefill, pair.decode)}


def test_qp_error_names_the_verbs_status_and_the_qp_is_rebuilt(
        wire_pair: WirePair, clients: tuple[KvbeamClient, KvbeamClient]) -> None:
    pair = wire_pair
    p, d = clients
    assert run_request(p, d, "qp-warm", 2048, 0, timeout=120).ok
    qp_before = one_qp_each(pair)
    # Prefill's test-only fault hook aims this request's first block just past decode's
    # lowest memory region: decode's device refuses it and both QPs go to the error state.
    rid = "qperr-1"
    d.reserve(rid, 4096, pair.prefill.address)
    t0 = time.monotonic()
    p.send(rid, 1, 4096, pair.decode.address)
    pst, tp = _wait(p, rid, t0)
    dst, td = _wait(d, rid, t0)
    report("remote write outside the MR", "prefill", pst, tp)
    report("remote write outside the MR", "decode", dst, td)
    assert pst.state is F and "IBV_WC_REM_ACCESS_ERR" in pst.detail, pst
    # Decode learns it from prefill (which names REM_ACCESS_ERR) or from its own QP, whose
    # receive WRs were flushed (IBV_WC_WR_FLUSH_ERR): a verbs status either way.
    # On failure, what both daemons logged of the request (it failed once in a full
    # suite run with decode's request left in Bootstrapping: neither path told it).
    if not (dst.state is F and "IBV_WC_" in dst.detail):
        for role, lines in _lines_of(pair, rid).items():
            print(f"--- {role} daemon, lines of {rid} and its links:\n" + "".join(lines))
    assert dst.state is F and "IBV_WC_" in dst.detail, dst
    # At once: the device refused the first write (not worth a resend: no resend was
    # tried, no deadline waited for), and decode heard it from prefill, not from its own
    # Transferring deadline (TIMEOUT, "no progress in Transferring").
    assert pst.reason is FailureReason.TRANSPORT_ERROR and "resend" not in pst.detail, pst
    assert told_by_prefill(dst), dst
    assert "FAULT INJECTED: writing" in pair.prefill.output
    # The next request handshakes again: new QPs on both sides, the failed ones destroyed.
    assert run_request(p, d, "qp-after", 8192, 2, timeout=120).ok
    qp_after = one_qp_each(pair)
    assert qp_after[0] != qp_before[0] and qp_after[1] != qp_before[1], (qp_before, qp_after)
    assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 30)


def test_sigkill_during_the_handshake_and_while_idle(
        wire_pair: WirePair, clients: tuple[KvbeamClient, KvbeamClient]) -> None:
    """A second prefill killed in Bootstrapping (handshaking), a second decode killed idle.

    The pair's own daemons survive: each must fail what it had with the dead peer, free
    everything, drop its connection and QP to it (an idle RDMA peer that dies makes no
    completion at all: its peer channel's socket, closed with the process, finds it),
    and keep serving.
    """
    pair = wire_pair
    p, d = clients
    # The pair's own link exists whatever ran before (the QP counts below include it).
    assert run_request(p, d, "sigkill-warm", 4096, 0, timeout=120).ok
    extra_prefill = spawn("prefill", transport="rdma", extra=pair.wire.rdma_args("prefill"))
    extra_decode = spawn("decode", transport="rdma", extra=pair.wire.rdma_args("decode"))
    p2 = extra_prefill.ready(STARTUP_S)
    try:
        d2 = extra_decode.ready(STARTUP_S)
    except BaseException:
        p2.stop()
        raise
    try:
        # 1. The second prefill dies the moment our decode has verified it and connected a
        #    QP to it: decode holds the reservation and a QP to a dead peer.
        with KvbeamClient(p2.address) as c2:
            d.reserve("kill-boot", 8000, p2.address)
            c2.send("kill-boot", 0, 8000, pair.decode.address)
            assert wait_until(lambda: f"prefill {p2.instance_id}" in pair.decode.output, 60,
                              interval=0.01)
            p2.kill()
            t0 = time.monotonic()
            state = TransferState.BOOTSTRAPPING if "kill-boot: posted" not in p2.output \
                else TransferState.TRANSFERRING
        dst, td = _wait(d, "kill-boot", t0)
        report(f"prefill SIGKILL in {state.value}", "decode", dst, td)
        # Decode dials the prefill its reservation names (decode-initiated pairing): a
        # prefill dead before that link was up is unreachable at once; one that died on
        # an open link fails it (peer_failed); the Bootstrapping deadline (20 s in
        # SLOW_GUEST) bounds the rest.
        assert dst.state is F and dst.reason in (FailureReason.PEER_FAILED,
                                                 FailureReason.PEER_UNREACHABLE,
                                                 FailureReason.TIMEOUT), dst
        # Noticed by the loss of the peer (its channel, its Connect), else by that
        # deadline itself, naming its configured seconds: not by another, longer one.
        assert dst.reason is not FailureReason.TIMEOUT or (
            own_deadline(dst) and "Bootstrapping" in dst.detail), dst
        # 2. Our prefill serves the second decode, which then dies while idle.
        with KvbeamClient(d2.address) as c2:
            assert run_request(p, c2, "to-second", 4096, 1, timeout=120).ok
        assert len(netfaults.qps(pair.wire.prefill_device)) == 2, netfaults.qp_table()
        t0 = time.monotonic()
        seen = len(pair.prefill.lines)
        d2.kill()
        # Nothing of the dead peers stays: one QP each (to each other), every slot free.
        one_qp_each(pair)
        print(f"FAULT decode SIGKILL while idle: prefill dropped its QP to it after "
              f"{time.monotonic() - t0:.2f}s")
        # Prefill found it at once, by its peer channel's socket closing with the
        # process: not by the channel's heartbeat silence (11 s: "peer stopped answering
        # heartbeats"), nor by the sweep that drops a connection left without a channel
        # for the peer timeout ("dropped: no open peer channel for ...").
        after = pair.prefill.lines[seen:]
        closed = [ln for ln in after
                  if f"peer channel to decode {d2.instance_id} at {d2.address} closed: " in ln]
        assert len(closed) == 1 and CHANNEL_EOF.search(closed[0]), after
        assert not [ln for ln in after if f"connection to peer {d2.instance_id} " in ln
                    and " dropped: " in ln], after
        assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 30)
        assert run_request(p, d, "kill-after", 4096, 4, timeout=120).ok
    finally:
        p2.stop()
        d2.stop()


def test_nothing_leaked_after_the_faults(wire_pair: WirePair,
                                         clients: tuple[KvbeamClient, KvbeamClient]) -> None:
    """Every slot and transfer came back: a full house of concurrent requests succeeds."""
    pair = wire_pair
    _, d = clients
    assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 30)
    results = drive(pair.prefill.address, pair.decode.address, [4096] * DECODE_SLOTS,
                    source_slots=8, concurrency=DECODE_SLOTS, timeout=180, prefix="full")
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    one_qp_each(pair)
    assert "XXH3-128 mismatch" not in pair.decode.output
