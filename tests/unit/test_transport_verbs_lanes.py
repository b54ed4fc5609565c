"""Several QPs per verbs link, on the host: striping, merged completions, the marker's
proof of arrival across QPs, and a QP error failing only the requests that used it.

Fake QPs (tests/verbs_fakes.py) complete in order as RC QPs do; ``frozen`` stops one
from completing anything, as a slow or stuck QP would.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbeam.errors import TransportError
from kvbeam.transport.base import EventKind
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import Prepared
from kvbeam.transport.endpoint import Endpoint, RemoteRegion
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs.lanes import lanes_for, stripe, stripe_slice
from tests.verbs_fakes import FakePoster, FakeQP, blocks, lane_held, make_lanes, run

WRITE_WITH_IMM = 1
OPTS = TransportOptions(sq_depth=64, signal_every=8, max_chain=32, slice_bytes=1 << 20,
                        stripe_min_bytes=64 << 10)


def markers(qp: FakeQP) -> int:
    return sum(1 for opcode, _ in qp.log if opcode == WRITE_WITH_IMM)


def data_bytes(qp: FakeQP) -> int:
    return sum(n for opcode, n in qp.log if opcode != WRITE_WITH_IMM)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 1 << 22), min_size=1, max_size=40), st.integers(1, 6))
def test_stripe_cuts_contiguous_shares_of_about_equal_bytes(sizes: list[int], k: int) -> None:
    lengths = np.array(sizes, dtype=np.uint64)
    total = int(lengths.sum())
    z = np.zeros(len(sizes), np.uint32)
    p = Prepared(7, True, np.cumsum(lengths) - lengths, lengths * 0, lengths, z, z)
    shares = stripe(p, k)
    assert 1 <= len(shares) <= k and all(len(s) for s in shares)
    assert np.array_equal(np.concatenate([s.src for s in shares]), p.src)  # in order, whole
    assert [s.notify for s in shares] == [False] * (len(shares) - 1) + [True]
    biggest = max(sizes)
    for s in shares:  # each share within one block of its fair part
        assert int(s.lengths.sum()) <= total / len(shares) + biggest


def test_lanes_and_slices_for_a_request() -> None:
    assert lanes_for(100 << 10, 4, 256 << 10) == 1  # small: one QP, marker in its chain
    assert lanes_for(600 << 10, 4, 256 << 10) == 2
    assert lanes_for(64 << 20, 4, 256 << 10) == 4
    # one 1 MiB block over 4 QPs is sliced into 256 KiB pieces, one per QP
    assert stripe_slice(1 << 20, 4, 1 << 20) == 256 << 10
    assert stripe_slice(64 << 20, 4, 1 << 20) == 1 << 20


@pytest.mark.parametrize("n", [2, 4])
def test_a_large_request_is_striped_evenly_and_completes_once(n: int) -> None:
    link, qps, t = make_lanes(OPTS, n)
    link.write(3, blocks(1, 8 << 20), notify=True)  # one contiguous 8 MiB run
    run(link, *qps)
    per_qp = [data_bytes(q) for q in qps]
    assert sum(per_qp) == 8 << 20 and max(per_qp) - min(per_qp) <= 1 << 20
    assert sum(markers(q) for q in qps) == 1
    assert [(e.kind, e.transfer_id, e.ok) for e in t.events] == [(EventKind.COMPLETED, 3, True)]
    assert all(q.max_outstanding <= OPTS.sq_depth for q in qps) and link.outstanding == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([4 << 10, 64 << 10]),
                          st.booleans()), min_size=1, max_size=10), st.sampled_from([2, 3, 4]))
def test_every_request_completes_once_with_one_marker_per_notify(
        writes: list[tuple[int, int, bool]], n: int) -> None:
    link, qps, t = make_lanes(OPTS, n)
    for i, (count, size, notify) in enumerate(writes):
        link.write(i, blocks(count, size), notify)
    run(link, *qps)
    assert sorted(e.transfer_id or 0 for e in t.events) == list(range(len(writes)))
    assert all(e.ok and e.kind is EventKind.COMPLETED for e in t.events)
    assert sum(markers(q) for q in qps) == sum(notify for _, _, notify in writes)
    assert sum(data_bytes(q) for q in qps) == sum(c * s for c, s, _ in writes)
    assert all(lane.idle for lane in link._lanes) and not link._requests.waiting


@pytest.mark.parametrize("slow", [0, 1, 2, 3])
def test_marker_waits_for_every_other_qp_to_complete(slow: int) -> None:
    """The proof of arrival: while QP ``slow`` has not completed its share, no WRITE WITH
    IMM is posted on another QP, though every other QP's share completed. On its own QP
    (the home QP, 3: the last share's) it may be posted, after the share: RC orders it."""
    link, qps, t = make_lanes(OPTS, 4)
    qps[slow].frozen = True
    link.write(9, blocks(16, 1 << 20), notify=True)
    run(link, *qps)
    assert all(data_bytes(q) == 4 << 20 for q in qps)  # every share posted
    assert all(not q.posted for i, q in enumerate(qps) if i != slow)  # the others completed
    assert t.events == []
    if slow == 3:
        assert [op for op, _ in qps[3].log][-1] == WRITE_WITH_IMM  # behind the share
    else:
        assert sum(markers(q) for q in qps) == 0
    qps[slow].frozen = False
    run(link, *qps)
    assert markers(qps[3]) == 1 and sum(markers(q) for q in qps) == 1
    assert [(e.transfer_id, e.ok) for e in t.events] == [(9, True)]


def test_a_held_lane_posts_nothing_and_no_marker_goes_until_it_is_released() -> None:
    """tests/verbs_fakes.lane_held (the multi-QP RDMA test's hold on QP 0): the held
    lane's share stays unposted, the others' are posted and complete, and the proof of
    arrival waits for the held share."""
    link, qps, t = make_lanes(OPTS, 4)
    with lane_held(link, 0):
        link.write(9, blocks(16, 1 << 20), notify=True)
        run(link, *qps)
        assert qps[0].log == []
        assert all(data_bytes(q) == 4 << 20 for q in qps[1:])
        assert sum(markers(q) for q in qps) == 0 and t.events == []
    assert qps[0].sq_depth == OPTS.sq_depth
    run(link, *qps)
    assert data_bytes(qps[0]) == 4 << 20 and sum(markers(q) for q in qps) == 1
    assert [(e.transfer_id, e.ok) for e in t.events] == [(9, True)]


def lanes_of(link: Any) -> dict[int, set[int]]:
    """Transfer id -> the QPs (lane indices) its submitted, not yet queued writes use."""
    out: dict[int, set[int]] = {}
    for request, jobs in link._submitted:
        out.setdefault(request.transfer_id, set()).update(lane.index for lane, _ in jobs)
    return out


def test_marker_covers_earlier_chunks_of_the_transfer_on_other_qps() -> None:
    link, qps, t = make_lanes(OPTS, 2)
    link.write(5, blocks(2, 4096), notify=False)  # small: one QP
    (first,) = lanes_of(link)[5]
    link.write(5, blocks(2, 4096), notify=True)  # small: the other QP (round-robin)
    assert lanes_of(link)[5] == {0, 1}
    qps[first].frozen = True
    run(link, *qps)
    assert sum(data_bytes(q) for q in qps) == 4 * 4096
    assert sum(markers(q) for q in qps) == 0  # the first chunk has not completed
    qps[first].frozen = False
    run(link, *qps)
    assert markers(qps[1 - first]) == 1
    assert [e.ok for e in t.events] == [True, True]


def test_a_qp_error_fails_only_the_requests_that_used_it() -> None:
    link, qps, t = make_lanes(OPTS, 4)
    link.write(1, blocks(8, 1 << 20))  # striped over all four QPs
    for i in range(2, 6):
        link.write(i, blocks(1, 4096))  # small: one QP each, round-robin
    used = lanes_of(link)
    assert used[1] == {0, 1, 2, 3} and sorted(min(used[i]) for i in range(2, 6)) == [0, 1, 2, 3]
    (broken,) = used[2]
    cast(Any, link).service(FakePoster(), 0.0)  # everything posted, nothing reaped yet
    qps[broken].fail_next = 12  # IBV_WC_RETRY_EXC_ERR
    run(link, *qps)
    outcome = {e.transfer_id: (e.ok, e.status) for e in t.events}
    assert len(t.events) == 5 and all(e.kind is EventKind.COMPLETED for e in t.events)
    assert outcome == {1: (False, "IBV_WC_RETRY_EXC_ERR"), 2: (False, "IBV_WC_RETRY_EXC_ERR"),
                       3: (True, "OK"), 4: (True, "OK"), 5: (True, "OK")}
    assert all(q.closed for q in qps) and t.revoked == [1]  # torn down once drained
    with pytest.raises(TransportError, match="create a new link") as exc:
        link.write(9, blocks(1, 64))
    assert exc.value.status == "IBV_WC_RETRY_EXC_ERR"


def test_a_failed_request_is_reported_only_after_its_other_shares_completed() -> None:
    link, qps, t = make_lanes(OPTS, 2)
    link.write(1, blocks(4, 1 << 20))
    cast(Any, link).service(FakePoster(), 0.0)
    qps[1].frozen = True  # its share of request 1 is still in flight
    qps[0].fail_next = 12
    run(link, *qps)
    assert t.events == []  # QP 1 may still read the source buffers
    qps[1].frozen = False
    run(link, *qps)
    assert [(e.transfer_id, e.ok, e.status) for e in t.events] == [
        (1, False, "IBV_WC_RETRY_EXC_ERR")]


@pytest.mark.parametrize("n", [2, 4])
def test_a_qp_error_with_no_request_on_it_is_a_link_failure(n: int) -> None:
    link, qps, t = make_lanes(OPTS, n)
    link.write(1, blocks(1, 4096))  # one QP only: the first
    run(link, *qps)
    flushed = type("WC", (), {"wr_id": 1 << 63, "status": 5, "vendor_err": 0})
    cast(Any, qps[0]).poll = lambda n: [flushed]  # a flushed receive on the first QP
    run(link, *qps)  # the link ends while its other QPs are still to be polled
    assert [(e.kind, e.status) for e in t.events[1:]] == [
        (EventKind.LINK_FAILED, "IBV_WC_WR_FLUSH_ERR")]
    assert all(q.closed for q in qps) and not link.active


def test_qp_counts_must_match_and_the_refusal_names_both() -> None:
    link, _, _ = make_lanes(OPTS, 2)
    fresh = type(link)(link._t, 2, [cast(Any, FakeQP(64)) for _ in range(4)])
    with pytest.raises(TransportError, match=r"peer has 2 QPs per link and this side 4"):
        fresh.connect(Endpoint("rdma", (RemoteRegion(0x4000_0000, 1 << 30, 9),),
                               gid="fe80::2", qpns=(5, 6), psn=3, mtu=4096))
    assert fresh.endpoint.qpns == (99, 99, 99, 99) and fresh.endpoint.psn == 1


def test_a_chunk_whose_request_never_sends_its_final_chunk_leaves_no_entry() -> None:
    """A non-final chunk (no marker) of a request that is then abandoned (aborted, its
    deadline passed): once its writes completed nothing of it stays for the link's life."""
    link, qps, t = make_lanes(OPTS, 2)
    link.write(5, blocks(2, 4096), notify=False)
    link.write(6, blocks(8, 1 << 20), notify=False)  # striped over both QPs
    run(link, *qps)
    assert [e.ok for e in t.events] == [True, True]
    assert cast(Any, link)._requests._last == {}
    link.write(7, Blocks.empty(), notify=False)  # nothing to post at all
    run(link, *qps)
    assert cast(Any, link)._requests._last == {}


def test_a_chunk_that_fails_before_the_final_one_leaves_no_entry() -> None:
    link, qps, t = make_lanes(OPTS, 2)
    link.write(5, blocks(8, 1 << 20), notify=False)  # striped over both QPs
    cast(Any, link).service(FakePoster(), 0.0)
    qps[0].fail_next = 12  # IBV_WC_RETRY_EXC_ERR
    run(link, *qps)
    assert [(e.transfer_id, e.ok) for e in t.events] == [(5, False)]
    assert cast(Any, link)._requests._last == {}


def test_an_earlier_chunk_still_in_flight_keeps_its_entry_for_the_marker() -> None:
    """The entry is dropped only once every write it names completed: the final chunk's
    marker must still wait for an earlier chunk on another QP (see the test above)."""
    link, qps, _ = make_lanes(OPTS, 2)
    link.write(5, blocks(2, 4096), notify=False)
    (first,) = lanes_of(link)[5]
    qps[first].frozen = True
    run(link, *qps)
    assert set(cast(Any, link)._requests._last) == {5}
    qps[first].frozen = False
    run(link, *qps)
    assert cast(Any, link)._requests._last == {}
