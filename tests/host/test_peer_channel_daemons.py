"""The peer channel between real daemons over TCP (protocol 4, server/peers/channel.py).

The frames and the channel's own states are unit-tested in
tests/unit/test_peer_channel.py; here two daemons use it: per-request calls go over it
(and only over it: no RPC stands in), its loss (a killed peer, no heartbeat involved)
fails that peer's requests at once, and a channel closed with a BYE is replaced by the
next request's handshake.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.scheduler import run_request
from kvbeam.server.api.decode import DecodeServicer
from kvbeam.server.api.prefill import PrefillServicer
from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import resolve
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport.tcp import TcpTransport
from kvbeam.transport.tcp.link import TcpLink
from tests.daemon_helpers import DECODE_SLOTS, free_slots, pair, start
from tests.fixtures import shipped_config
from tests.waiting import wait_until

F = TransferState.FAILED
#: Heartbeats (gRPC or on the channel) far apart: only the channel's closing can tell.
NO_BEATS = ["--heartbeat-s", "3600"]


def test_per_request_calls_go_over_the_peer_channel() -> None:
    with pair() as (prefill, decode, p, d):
        for i in range(3):
            assert run_request(p, d, f"chan-{i}", 500, i).ok
        assert "verified and connected (tcp, peer channel)" in prefill.output, \
            prefill.output[-3000:]
        bound = [line for line in decode.output.splitlines()
                 if "peer channel from prefill" in line and "bound" in line]
        assert len(bound) == 1, decode.output[-3000:]  # one channel for the pair
        # No offer failed (there is no RPC to fall back to: every one went over it).
        assert "offer of" not in decode.output, decode.output[-3000:]


def test_every_daemon_thread_is_named_in_the_os() -> None:
    """top -H and the bench's CPU split by thread read the kernel's names (15 bytes)."""
    with pair() as (prefill, decode, p, d):
        assert run_request(p, d, "named", 500, 0).ok
        for daemon in (prefill, decode):
            names = {path.read_text().strip()
                     for path in Path(f"/proc/{daemon.proc.pid}/task").glob("*/comm")}
            want = {"kvbeam-loop", "kvbeam-control_"}
            assert want <= names, (daemon.role, sorted(names))
            # One loop serves the peer channels, the TCP sockets, the events and the sweep.
            assert not names & {"kvbeam-peer-cha", "kvbeam-events", "kvbeam-sweeper",
                                "kvbeam-attach"}, sorted(names)
            # The daemon's loop serves the TCP data plane too, however many links and
            # connections: no thread of its own.
            assert not {n for n in names if n.startswith("kvbeam-tcp")}, sorted(names)


def test_a_killed_prefill_fails_decodes_offered_request_at_once() -> None:
    """Decode offered a reservation to prefill; prefill is SIGKILLed: the channel's EOF
    fails the request with peer_failed (without the channel: its lease, timeout)."""
    decode = start("decode", extra=NO_BEATS)
    try:
        prefill = start("prefill", extra=NO_BEATS)
        with KvbeamClient(decode.address) as d, KvbeamClient(prefill.address) as p:
            assert run_request(p, d, "warm", 500, 0).ok  # the pair has its channel
            assert "peer channel from prefill" in decode.output, decode.output[-3000:]
            d.reserve("offered", 2000, prefill.address)
            prefill.kill()
            st = d.wait("offered", 20)
            logs = f"{st}\n--- decode ---\n{decode.output[-4000:]}\n--- prefill ---\n" \
                   f"{prefill.output[-4000:]}"
            assert st.state is F and st.reason is FailureReason.PEER_FAILED, logs
            assert "peer channel" in st.detail, logs
            assert free_slots(d) == DECODE_SLOTS
    finally:
        decode.stop()


def test_a_killed_decode_is_noticed_by_prefill_and_the_next_decode_serves() -> None:
    prefill = start("prefill", extra=NO_BEATS)
    try:
        decode = start("decode", extra=NO_BEATS)
        with KvbeamClient(prefill.address) as p:
            with KvbeamClient(decode.address) as d:
                assert run_request(p, d, "warm", 500, 0).ok
            decode.kill()
            decode2 = start("decode", extra=NO_BEATS)
            try:
                with KvbeamClient(decode2.address) as d2:
                    assert run_request(p, d2, "after", 500, 1).ok
            finally:
                decode2.stop()
        # The killed decode's channel closed without a BYE: prefill dropped that peer. Its
        # channel's reader ("the peer closed the connection") or its data link's, which
        # releases the peer ("its connection was closed on this side"), sees the kill
        # first: either, but never the BYE of an orderly close ("the peer closed it: ...").
        gone = re.compile(rf"peer channel to decode \S+ at {re.escape(decode.address)} "
                          r"closed: (?!the peer closed it)")
        assert wait_until(lambda: gone.search(prefill.output) is not None,
                          10), prefill.output[-3000:]
    finally:
        prefill.stop()


@contextmanager
def _in_process() -> Iterator[tuple[PrefillServicer, DecodeServicer]]:
    """A prefill and a decode daemon in this process (real runtimes, TCP), so a test can
    make decode replace its side of the pair as a failed link or detach would."""
    servicers: list[Any] = []
    try:
        for role, kind in (("decode", DecodeServicer), ("prefill", PrefillServicer)):
            env = {"KVBEAM_CONFIG": shipped_config(role), "KVBEAM_LISTEN": "127.0.0.1:0",
                   "KVBEAM_TRANSPORT": "tcp", "KVBEAM_HEARTBEAT_S": "3600",
                   "KVBEAM_FILL_SEED": "1" if role == "prefill" else "2"}
            runtime = Runtime(resolve(role, None, env))
            servicer = kind(runtime)
            runtime.start(servicer)
            servicers.append(servicer)
        yield servicers[1], servicers[0]
    finally:
        for servicer in reversed(servicers):
            servicer.rt.stop(grace=0.5)


def _channel_of(servicer: Any) -> Any:
    conns = servicer.rt.peers.all()
    assert len(conns) == 1, conns
    return conns[0].channel


@pytest.mark.parametrize("how", ["link", "channel"])
def test_a_channel_closed_with_a_bye_is_replaced_by_the_next_requests_handshake(
        caplog: pytest.LogCaptureFixture, how: str) -> None:
    """Decode releases its side of the pair (``link``: its link failed, say), or only
    its channel (``channel``: the link stays, so prefill's connection does too): the
    channel closes with a BYE (``link``: when prefill's next handshake retires the
    channel both sides kept), so neither side takes the other for gone. No RPC stands
    in for the channel: decode makes no offer on a connection without one, and prefill's
    next request drops such a connection and handshakes again, over a new link and a new
    channel, and succeeds; so does the one after it, on that channel."""
    caplog.set_level(logging.INFO)
    with _in_process() as (prefill, decode), \
            KvbeamClient(prefill.rt.local.control_address) as p, \
            KvbeamClient(decode.rt.local.control_address) as d:
        assert run_request(p, d, "before", 500, 0).ok
        old = _channel_of(prefill)
        assert old is not None and not old.closed
        (conn,) = decode.rt.peers.all()
        if how == "link":
            decode.peer_lost(conn, "test: the link is replaced", gone=False)
            # Both sides keep their channel when only the link failed: prefill's link
            # fails, and its channel retires when the next request handshakes again.
            assert wait_until(lambda: not prefill.rt.peers.all(), 10), "the link never failed"
            assert not old.closed
        else:
            conn.channel.close("test: the channel is replaced", bye=True)
            assert wait_until(lambda: old.closed, 10), "prefill never heard the BYE"
        for i in range(2):
            result = run_request(p, d, f"after-{i}", 500, i + 1)
            assert result.ok, (result, caplog.text[-4000:])
        assert wait_until(lambda: old.closed, 10), "the old channel was never retired"
        assert old.orderly, old.close_reason  # a BYE: the peer lives
        new = _channel_of(prefill)
        assert new is not old and not new.closed
        assert _channel_of(decode) is not None and not _channel_of(decode).closed
    bound = [r for r in caplog.records if "peer channel from prefill" in r.getMessage()
             and "bound" in r.getMessage()]
    assert len(bound) == 2, caplog.text[-4000:]  # the first channel, and its replacement
    if how == "channel":  # prefill's connection outlived its channel: dropped, not used
        # (by the next Send's step, or first by decode's Connect ask for its reservation)
        assert "dropping that connection" in caplog.text, caplog.text[-4000:]
    assert "not made" not in caplog.text  # no offer failed: none was tried without one
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-4000:]


def test_a_request_whose_resend_cannot_connect_is_told_to_decode_over_the_kept_channel(
        caplog: pytest.LogCaptureFixture) -> None:
    """The data path breaks mid-request and stays broken (decode's data port refuses new
    connections) while both daemons live: prefill's link fails, each resend's handshake
    fails to connect a new link, and the request fails on prefill. Prefill kept its side
    of the peer channel when only the link failed (as decode does), so it tells decode
    over that channel at once: decode's request fails with prefill's word, not at its own
    deadline. A later handshake (the data port back) retires the kept channel with a BYE."""
    caplog.set_level(logging.INFO)
    with _in_process() as (prefill, decode), \
            KvbeamClient(prefill.rt.local.control_address) as p, \
            KvbeamClient(decode.rt.local.control_address) as d:
        assert run_request(p, d, "warm", 500, 0).ok
        (conn,) = prefill.rt.peers.all()
        kept = conn.channel
        d.reserve("cut", 4096, prefill.rt.local.control_address)
        p.send("cut", 1, 4096, decode.rt.local.control_address, final=False,
               chunks=[(0, 1024)])
        assert wait_until(lambda: p.status("cut").bytes_done > 0, 30)
        # The data path breaks: decode's data port refuses, prefill's link is cut.
        transport = decode.rt.transport
        link = conn.link
        assert isinstance(transport, TcpTransport) and isinstance(link, TcpLink)
        listener = transport._listener  # the test cuts the data port
        decode.rt.loop.run_sync(lambda: transport.selector.unregister(listener))
        listener.close()
        assert link._sock is not None
        link._sock.shutdown(socket.SHUT_RDWR)
        p.send("cut", 1, 4096, decode.rt.local.control_address)
        pst = p.wait("cut", 30)
        assert pst.state is TransferState.FAILED, pst
        dst = d.wait("cut", 10)
        assert dst.state is TransferState.FAILED, dst
        assert dst.reason is FailureReason.PEER_FAILED and "prefill failed" in dst.detail, dst
        assert not kept.closed  # the kept channel carried the Abort
    assert "could not tell" not in caplog.text, caplog.text[-4000:]
