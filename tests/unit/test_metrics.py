"""Metrics without daemons: the lifecycle observer, the scrape-time collector over a fake
transport, the /metrics endpoint, and the TCP transport's own counters."""

from __future__ import annotations

import mmap
import socket
import time
from collections.abc import Iterable
from types import MappingProxyType

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvbeam.errors import ListenError
from kvbeam.server.metrics import TRANSFER_BUCKETS, DaemonMetrics
from kvbeam.server.metrics_collector import DaemonCollector, Sources
from kvbeam.server.metrics_http import MAX_CONNECTIONS
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.states import FailureReason, TransferState, TransferStatus
from kvbeam.transport import Access, Event, Region
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.stats import TransportStats
from kvbeam.transport.tcp import TcpTransport
from tests.metrics_helpers import collect, scrape, value
from tests.transport_helpers import plan
from tests.transport_peer import buffer_address


def table_with(metrics: DaemonMetrics) -> TransferTable:
    return TransferTable(Deadlines(1.0, 1.0, 1.0), on_change=metrics.on_change)


def test_observer_counts_creations_outcomes_latency_and_bytes() -> None:
    m = DaemonMetrics("decode")
    t = table_with(m)
    t.create("ok", "10.0.0.1:1", now=0.0)
    t.create("bad", "10.0.0.1:1", now=0.0)
    s = collect(m.registry)
    assert value(s, "kvbeam_transfers_started_total") == 2
    assert value(s, "kvbeam_transfers_total", state="Success", reason="none") == 0
    t.advance("ok", TransferState.WAITING_FOR_INPUT, now=0.0)
    t.advance("ok", TransferState.TRANSFERRING, now=0.0)
    assert t.advance("ok", TransferState.SUCCESS, nbytes=1000, now=0.0).nbytes == 1000
    t.fail("bad", FailureReason.ABORTED, "test", now=0.0)
    t.fail("bad", FailureReason.TIMEOUT, "already failed: no change, no count", now=0.0)
    s = collect(m.registry)
    assert value(s, "kvbeam_transfers_total", state="Success", reason="none") == 1
    assert value(s, "kvbeam_transfers_total", state="Failed", reason="aborted") == 1
    assert value(s, "kvbeam_transfers_total", state="Failed", reason="timeout") == 0
    assert value(s, "kvbeam_transfer_seconds_count", state="Success") == 1
    assert value(s, "kvbeam_transfer_seconds_count", state="Failed") == 1
    # only Success counts bytes: a failed request's partial bytes are not "transferred"
    assert value(s, "kvbeam_request_bytes_total") == 1000


def test_per_request_series_read_as_prometheus_clients_own() -> None:
    """The per-request series are plain numbers exported at scrape time: the same
    samples (buckets at their bounds, sums, ``_created``) as a prometheus_client
    Histogram and Counter given the same observations."""
    m = DaemonMetrics("prefill")
    ref_registry = CollectorRegistry()
    ref = Histogram("kvbeam_transfer_seconds", "reference", ["state"],
                    buckets=TRANSFER_BUCKETS, registry=ref_registry)
    offers = Counter("kvbeam_offers", "reference", ["event"], registry=ref_registry)
    for version, age in enumerate((0.005, 0.0031, 200.0, 1.0, 0.0), start=3):
        m.on_change(TransferStatus("r", "p", TransferState.SUCCESS, None, "", version, age, 8))
        ref.labels("Success").observe(age)
    for event in ("received", "used", "unheard-of"):
        m.count_offer(event)
        offers.labels(event).inc()
    s, want = collect(m.registry), collect(ref_registry)
    for (name, labels), v in want.items():
        if name.endswith("_created"):
            assert (name, labels) in s
        else:
            assert s[name, labels] == v, (name, labels)
    assert value(s, "kvbeam_request_bytes_total") == 40


def test_handshake_timer_counts_ok_and_failed() -> None:
    m = DaemonMetrics("prefill")
    with m.handshake("client"):
        time.sleep(0.002)
    with pytest.raises(ValueError), m.handshake("client"):
        raise ValueError("refused")
    s = collect(m.registry)
    assert value(s, "kvbeam_handshakes_total", side="client", result="ok") == 1
    assert value(s, "kvbeam_handshakes_total", side="client", result="failed") == 1
    assert value(s, "kvbeam_handshake_seconds_count", side="client") == 2
    assert value(s, "kvbeam_handshake_seconds_sum", side="client") >= 0.002


class FakeTransport:
    """Stands in for a transport: only stats() matters to the collector."""

    def __init__(self) -> None:
        self.now = TransportStats()

    def stats(self) -> TransportStats:
        return self.now


def status(rid: str, state: TransferState) -> TransferStatus:
    return TransferStatus(rid, "peer:1", state, None, "", 0, 0.0)


def test_collector_publishes_a_fake_transport_and_the_daemon_levels() -> None:
    m = DaemonMetrics("decode")
    fake = FakeTransport()
    live: list[TransferStatus] = []
    held = [0]

    def live_now() -> Iterable[TransferStatus]:
        return list(live)

    m.registry.register(DaemonCollector(Sources(
        info={"role": "decode", "instance": "abc", "transport": "rdma", "version": "0"},
        transport=fake.stats, live=live_now, peers=lambda: 2,
        slots=lambda: (held[0], 16), loop_stalls=lambda: 3)))
    s = collect(m.registry)
    assert value(s, "kvbeam_info", role="decode", instance="abc", transport="rdma",
                 version="0") == 1
    assert value(s, "kvbeam_loop_stalls_total") == 3
    assert value(s, "kvbeam_slots") == 16 and value(s, "kvbeam_slots_reserved") == 0
    assert value(s, "kvbeam_transfers_live", state="Transferring") == 0
    assert ("kvbeam_transport_received_bytes_total", ()) not in s  # None: not exported
    assert ("kvbeam_transport_posted_wrs_total", ()) not in s

    fake.now = TransportStats(
        sent_bytes=4096, sent_blocks=3,
        completions=MappingProxyType({"OK": 5, "IBV_WC_REM_ACCESS_ERR": 1}),
        inflight_writes=2, notifications=4,
        link_failures=MappingProxyType({"IBV_WC_REM_ACCESS_ERR": 1}), links=3,
        posted_wrs=77, inflight_wrs=9)
    live += [status("a", TransferState.TRANSFERRING), status("b", TransferState.BOOTSTRAPPING),
             status("c", TransferState.TRANSFERRING)]
    held[0] = 3
    s = collect(m.registry)
    assert value(s, "kvbeam_transport_sent_bytes_total") == 4096
    assert value(s, "kvbeam_transport_sent_blocks_total") == 3
    assert value(s, "kvbeam_transport_write_completions_total", status="OK") == 5
    assert value(s, "kvbeam_transport_write_completions_total",
                 status="IBV_WC_REM_ACCESS_ERR") == 1
    assert value(s, "kvbeam_transport_link_failures_total", status="IBV_WC_REM_ACCESS_ERR") == 1
    assert value(s, "kvbeam_transport_inflight_writes") == 2
    assert value(s, "kvbeam_transport_notifications_total") == 4
    assert value(s, "kvbeam_transport_links") == 3
    assert value(s, "kvbeam_transport_posted_wrs_total") == 77
    assert value(s, "kvbeam_transport_inflight_wrs") == 9
    assert value(s, "kvbeam_transfers_live", state="Transferring") == 2
    assert value(s, "kvbeam_transfers_live", state="Bootstrapping") == 1
    assert value(s, "kvbeam_slots_reserved") == 3
    assert value(s, "kvbeam_peers") == 2


def test_prefill_collector_has_no_slots() -> None:
    m = DaemonMetrics("prefill")
    m.registry.register(DaemonCollector(Sources(
        info={"role": "prefill"}, transport=TransportStats, live=list, peers=lambda: 0)))
    s = collect(m.registry)
    assert not [k for k in s if k[0].startswith("kvbeam_slots")]


def test_registries_are_per_daemon() -> None:
    a, b = DaemonMetrics("prefill"), DaemonMetrics("decode")
    t = table_with(a)
    for rid in ("r1", "r2", "r3"):
        t.create(rid, "10.0.0.1:1", now=0.0)
    assert value(collect(a.registry), "kvbeam_transfers_started_total") == 3
    assert value(collect(b.registry), "kvbeam_transfers_started_total") == 0


def test_endpoint_binds_port_zero_and_refuses_a_port_in_use() -> None:
    m = DaemonMetrics("decode")
    table_with(m).create("r1", "10.0.0.1:1", now=0.0)
    bound = m.serve("127.0.0.1:0")
    try:
        host, _, port = bound.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert value(scrape(bound), "kvbeam_transfers_started_total") == 1
        other = DaemonMetrics("prefill")
        with pytest.raises(ListenError, match=f"cannot serve metrics on {bound}: .*in use"):
            other.serve(bound)
    finally:
        m.stop()
        m.stop()  # idempotent
    with socket.socket() as s:  # nothing listens there any more (TIME_WAIT aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(port)))


def _ask(bound: str, raw: bytes) -> bytes:
    """Send ``raw`` to the endpoint and read its whole answer (it closes the connection)."""
    host, _, port = bound.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_endpoint_answers_what_a_scraper_asks_and_refuses_the_rest() -> None:
    m = DaemonMetrics("prefill")
    table_with(m).create("r1", "10.0.0.1:1", now=0.0)
    bound = m.serve("127.0.0.1:0")
    try:
        ok = _ask(bound, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n")
        head, _, body = ok.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in head
        assert f"Content-Length: {len(body)}".encode() in head
        assert b"kvbeam_transfers_started_total 1.0" in body
        only_head = _ask(bound, b"HEAD / HTTP/1.1\r\n\r\n")
        assert only_head.startswith(b"HTTP/1.1 200 OK") and only_head.endswith(b"\r\n\r\n")
        assert _ask(bound, b"GET /other HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
        assert _ask(bound, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
        assert _ask(bound, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400")
        huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000
        assert _ask(bound, huge).startswith(b"HTTP/1.1 431")
        # A scraper that connects and goes without asking costs nothing: the next one is
        # served as before.
        host, _, port = bound.rpartition(":")
        socket.create_connection((host, int(port)), timeout=10).close()
        assert value(scrape(bound), "kvbeam_transfers_started_total") == 1
    finally:
        m.stop()


def test_endpoint_closes_the_oldest_connection_past_its_limit() -> None:
    m = DaemonMetrics("decode")
    bound = m.serve("127.0.0.1:0")
    host, _, port = bound.rpartition(":")
    silent = [socket.create_connection((host, int(port)), timeout=10)
              for _ in range(MAX_CONNECTIONS + 1)]
    try:
        assert silent[0].recv(1) == b""  # closed by the endpoint: the oldest
        assert value(scrape(bound), "kvbeam_transfers_started_total") == 0  # still served
    finally:
        for s in silent:
            s.close()
        m.stop()


def test_tcp_transport_counts_sent_received_and_in_flight() -> None:
    n = 1 << 20
    src_buf, dst_buf = mmap.mmap(-1, n), mmap.mmap(-1, n)
    src_buf.write(np.arange(n, dtype=np.uint8).tobytes())
    options = TransportOptions(slice_bytes=64 << 10, op_timeout_s=5.0)
    sender, receiver = TcpTransport(options=options), TcpTransport(options=options)
    try:
        sender.register([Region(buffer_address(src_buf), n)], Access.LOCAL)
        receiver.register([Region(buffer_address(dst_buf), n)], Access.REMOTE_WRITE)
        out, inbound = sender.create_link(), receiver.create_link()
        inbound.connect(out.endpoint)
        out.connect(inbound.endpoint)
        rows = [(0, 0, 300_000), (400_000, 500_000, 4096), (700_000, 900_000, 0)]
        blocks = plan(buffer_address(src_buf), buffer_address(dst_buf), rows)
        out.write(5, blocks, notify=True)
        out.write(6, blocks, notify=False)
        events: list[Event] = []
        deadline = time.monotonic() + 10
        while len(events) < 2 and time.monotonic() < deadline:
            events += sender.events(0.5)
        assert [e.ok for e in events] == [True, True]
        notes = receiver.events(5.0)
        assert len(notes) == 1
        s = sender.stats()
        assert (s.sent_bytes, s.sent_blocks) == (2 * 304_096, 6)
        assert dict(s.completions) == {"OK": 2} and s.inflight_writes == 0
        assert s.links == 1 and s.posted_wrs is None and s.inflight_wrs is None
        r = receiver.stats()
        assert r.received_bytes == 2 * 304_096 and r.notifications == 1
        assert r.sent_bytes == 0 and not r.link_failures
    finally:
        sender.close()
        receiver.close()
        src_buf.close()
        dst_buf.close()
