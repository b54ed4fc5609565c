"""The verbs transport's WR building and send-queue accounting, on the host (no device).

A fake QP completes signalled WRs in order, as an RC QP does, so the link's
posting and retiring logic runs exactly as on a NIC.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbeam.errors import TransportError
from kvbeam.transport import status
from kvbeam.transport.base import Event, EventKind
from kvbeam.transport.core import Prepared
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs.chain import DESC_DTYPE, build
from kvbeam.transport.verbs.qp import RECV_TAG
from tests.verbs_fakes import FakePoster, blocks, make_link, run

U64 = np.uint64


def prepared(n: int, notify: bool, transfer_id: int = 7) -> Prepared:
    i = np.arange(n, dtype=np.uint64)
    return Prepared(transfer_id, notify, U64(0x1000) + i * U64(64), U64(0x9000) + i * U64(64),
                    np.full(n, 64, np.uint64), np.full(n, 5, np.uint32),
                    np.full(n, 6, np.uint32))


@pytest.mark.parametrize(("n", "notify", "every"), [(10, True, 4), (8, False, 4), (0, True, 4),
                                                    (1, False, 64), (64, True, 64)])
def test_build_describes_the_chain_and_picks_signals(n: int, notify: bool, every: int) -> None:
    b = build(prepared(n, notify), 3, every, (0xAAAA, 0xBB))
    total = n + notify
    assert b.n == total and b.descs.dtype == DESC_DTYPE
    if total == 0:
        return
    w = b.descs
    assert w["addr"][:n].tolist() == [0x1000 + 64 * i for i in range(n)]
    assert w["length"][:n].tolist() == [64] * n and w["lkey"][:n].tolist() == [5] * n
    assert w["remote_addr"][:n].tolist() == [0x9000 + 64 * i for i in range(n)]
    assert set(w["opcode"][:n].tolist()) <= {0} and set(w["num_sge"][:n].tolist()) <= {1}
    if notify:
        assert int(w["opcode"][-1]) == 1 and int(w["num_sge"][-1]) == 0  # WRITE WITH IMM
        assert int(w["imm_data"][-1]) == int.from_bytes((7).to_bytes(4, "big"), "little")
        assert (int(w["remote_addr"][-1]), int(w["rkey"][-1])) == (0xAAAA, 0xBB)
    signalled = np.flatnonzero(w["send_flags"] == 2).tolist()
    assert signalled == b.signal_pos
    assert signalled[-1] == total - 1  # the last WR always
    assert all(b - a <= every for a, b in zip([-1, *signalled], signalled, strict=False))
    assert [c for _, c, _ in b.signals] == np.diff([-1, *signalled]).tolist()
    assert sum(c for _, c, _ in b.signals) == total
    assert [t for _, _, t in b.signals] == [None] * (len(signalled) - 1) + [7]
    assert all(wr_id >> 32 == 3 and not wr_id & RECV_TAG for wr_id, _, _ in b.signals)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.booleans()), min_size=1, max_size=12),
       st.sampled_from([(16, 4, 8), (32, 8, 32), (512, 64, 256), (8, 8, 3)]))
def test_posting_never_overflows_and_completes_every_transfer(
        transfers: list[tuple[int, bool]], shape: tuple[int, int, int]) -> None:
    sq, every, chain = shape
    options = TransportOptions(sq_depth=sq, signal_every=every, max_chain=chain, slice_bytes=64)
    link, qp, t = make_link(options)
    for i, (n, notify) in enumerate(transfers):
        link.write(i, blocks(n, 64), notify)
    run(link, qp)
    assert qp.max_outstanding <= sq
    done = [e.transfer_id for e in t.events]
    assert sorted(d or 0 for d in done) == list(range(len(transfers)))
    assert all(e.ok and e.kind is EventKind.COMPLETED for e in t.events)
    with_wrs = [i for i, (n, notify) in enumerate(transfers) if n or notify]
    assert [d for d in done if d in with_wrs] == with_wrs  # in posting order
    assert link.outstanding == 0 and not link._lanes[0].inflight
    assert link.stats.wrs == sum(n + notify for n, notify in transfers)


def test_a_link_is_busy_from_its_write_until_every_wr_completed() -> None:
    """What the transport's loop reads (with what a service did) to decide whether it
    services again at once or arms the CQs and sleeps."""
    link, qp, _t = make_link(TransportOptions(sq_depth=16, signal_every=4, max_chain=8))
    assert not link.busy
    link.write(1, blocks(20, 64))
    assert link.busy  # submitted, not yet taken onto a lane
    run(link, qp)
    assert not link.busy and link.outstanding == 0


def test_error_completion_fails_everything_and_tears_down() -> None:
    link, qp, t = make_link(TransportOptions(sq_depth=16, signal_every=4, max_chain=8))
    for i in range(5):
        link.write(i, blocks(20, 64))
    qp.fail_next = 12  # IBV_WC_RETRY_EXC_ERR
    run(link, qp)
    assert [(e.transfer_id, e.ok, e.status) for e in t.events] == [
        (i, False, "IBV_WC_RETRY_EXC_ERR") for i in range(5)]
    assert qp.closed and t.revoked == [1]
    with pytest.raises(TransportError, match="create a new link") as exc:
        link.write(9, blocks(1, 64))
    assert exc.value.status == "IBV_WC_RETRY_EXC_ERR"


def test_receive_completion_becomes_a_notification() -> None:
    link, qp, t = make_link(TransportOptions())
    reposted: list[int] = []
    qp_any = cast(Any, qp)
    qp_any.repost_recv = reposted.append
    wc = SimpleNamespace(wr_id=RECV_TAG | 3, status=0, opcode=129, vendor_err=0,
                         imm_data=int.from_bytes((0xC0FFEE).to_bytes(4, "big"), "little"))
    qp_any.poll = lambda n: [wc] if not reposted else []
    link.service(cast(Any, FakePoster()), 0.0)
    assert t.events == [Event(EventKind.NOTIFIED, 1, 0xC0FFEE)]
    assert reposted == [RECV_TAG | 3]


def test_deadline_fails_a_silent_link() -> None:
    link, qp, t = make_link(TransportOptions(op_timeout_s=2.0))
    qp_any = cast(Any, qp)
    qp_any.poll = lambda n: []  # the NIC never answers
    qp_any.state = lambda: 3  # IBV_QPS_RTS
    link.write(1, blocks(4, 64))
    poster = cast(Any, FakePoster())
    link.service(poster, 100.0)
    assert link.deadline() == pytest.approx(102.0)
    link.service(poster, 101.0)
    assert t.events == []
    link.service(poster, 102.5)
    assert [(e.transfer_id, e.ok, e.status) for e in t.events] == [(1, False, status.TIMEOUT)]
    assert "state IBV_QPS_RTS" in t.events[0].detail


def test_release_cancels_queued_transfers() -> None:
    link, qp, t = make_link(TransportOptions())
    link.write(1, blocks(4, 64))
    link.release()
    assert [(e.transfer_id, e.status) for e in t.events] == [(1, status.CANCELLED)]
    assert qp.closed and t.revoked == [1]  # keys revoked once, with the QP gone
    with pytest.raises(TransportError, match="released"):
        link.write(2, blocks(1, 64))


def test_import_needs_neither_pyverbs_nor_torch() -> None:
    code = ("import sys, kvbeam.transport, kvbeam.transport.verbs, kvbeam.transport.tcp; "
            "bad = [m for m in ('pyverbs', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_opening_a_missing_device_is_a_transport_error() -> None:
    pytest.importorskip("pyverbs.device")
    from kvbeam.transport.verbs import VerbsTransport

    with pytest.raises(TransportError, match="no_such_dev0"):
        VerbsTransport("no_such_dev0")


def test_meter_counts_bytes_wrs_and_qp_errors() -> None:
    options = TransportOptions(sq_depth=16, signal_every=4, max_chain=8, slice_bytes=64)
    link, qp, t = make_link(options)
    link.write(1, blocks(10, 64))
    link.write(1, blocks(3, 128), notify=False)  # a second chunk of the same transfer id
    in_flight = t.meter.snapshot(links=1, wrs=True, inflight_wrs=link.outstanding)
    assert in_flight.inflight_writes == 2 and in_flight.sent_bytes == 0
    run(link, qp)
    s = t.meter.snapshot(links=1, wrs=True, inflight_wrs=link.outstanding)
    # blocks as the caller gave them; 128-byte blocks were sliced into two WRs each
    assert (s.sent_bytes, s.sent_blocks, s.inflight_writes) == (10 * 64 + 3 * 128, 13, 0)
    assert s.posted_wrs == 10 + 1 + 6 and s.inflight_wrs == 0
    assert dict(s.completions) == {"OK": 2} and s.received_bytes is None
    link.write(2, blocks(20, 64))
    qp.fail_next = 10  # IBV_WC_REM_ACCESS_ERR
    run(link, qp)
    s = t.meter.snapshot(links=0)
    assert s.sent_bytes == 10 * 64 + 3 * 128  # the failed transfer adds nothing
    assert dict(s.completions) == {"OK": 2, "IBV_WC_REM_ACCESS_ERR": 1}
    assert dict(s.link_failures) == {"IBV_WC_REM_ACCESS_ERR": 1}
    assert s.inflight_writes == 0
