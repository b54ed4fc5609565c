"""The daemon's I/O executor logs a job's error instead of dropping it with its future."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from kvbeam.server.executor import LoggingExecutor


def _abort_decode(request_id: str) -> None:
    raise ValueError(f"Cannot invoke RPC on closed channel! ({request_id})")


def test_a_failed_fire_and_forget_job_is_logged_with_its_name_and_error(
        caplog: pytest.LogCaptureFixture) -> None:
    with LoggingExecutor(max_workers=1) as pool, caplog.at_level(logging.ERROR):
        pool.submit(_abort_decode, "qperr-1")  # nobody keeps the future
    failed = [r for r in caplog.records if r.name == "kvbeam.server.executor"]
    assert len(failed) == 1, caplog.text
    assert "_abort_decode" in failed[0].getMessage()
    assert "closed channel! (qperr-1)" in failed[0].getMessage()
    assert failed[0].exc_info is not None


def test_jobs_that_return_or_are_cancelled_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    with caplog.at_level(logging.ERROR):
        pool = LoggingExecutor(max_workers=1)
        first = pool.submit(gate.wait, 5)
        queued = pool.submit(lambda: 1)
        assert queued.cancel()
        gate.set()
        assert first.result(5) is True
        pool.shutdown(wait=True)
    assert not [r for r in caplog.records if r.name == "kvbeam.server.executor"]


class _Call:
    def trailing_metadata(self) -> tuple[()]:
        return ()


class _Abort:
    def __init__(self, fails: bool) -> None:
        self.fails, self.calls = fails, 0

    def with_call(self, request: object, timeout: float) -> tuple[None, _Call]:
        self.calls += 1
        if self.fails:
            raise ValueError("Cannot invoke RPC on closed channel!")
        return None, _Call()


class _Client:
    def __init__(self, fails: bool) -> None:
        self.stub = type("Stub", (), {})()
        self.stub.Abort = _Abort(fails)

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _ClosingConn:
    """A connection whose link fails (and which closes) between the check and the call."""

    def __init__(self) -> None:
        self.closed = False
        self.channel = None  # no peer channel: the Abort is an RPC
        self.old = _Client(fails=True)

    def client(self) -> _Client:
        self.closed = True  # on_peer_lost closed it on another thread just now
        return self.old


def test_an_abort_whose_channel_closes_under_it_is_said_again_on_a_one_off_channel() -> None:
    from typing import Any

    from kvbeam.server.peer_rpc import GrpcDecodePeers

    one_off = _Client(fails=False)
    dial: Any = lambda _address: one_off  # noqa: E731
    local: Any = type("Local", (), {"instance_id": "p1"})()
    none: Any = None
    peers = GrpcDecodePeers(lambda: local, transport=none, dial=dial, metrics=none)
    conn: Any = _ClosingConn()
    assert peers.abort(conn, "decode:1", "qperr-1", "prefill failed", timeout=1.0) is True
    assert conn.old.stub.Abort.calls == 1 and one_off.stub.Abort.calls == 1


class _ByeChannel:
    """A peer channel the peer closes with a BYE while an Abort waits on it."""

    def __init__(self) -> None:
        self.closed = False
        self.calls = 0

    def call(self, kind: int, message: bytes, timeout: float) -> object:
        from kvbeam.errors import PeerChannelError

        self.calls += 1
        self.closed = True
        raise PeerChannelError(grpc.StatusCode.UNAVAILABLE, "peer channel closed: BYE")


class _ChannelConn:
    def __init__(self) -> None:
        self.closed = False  # a BYE retires the channel only: the connection stays
        self.channel = _ByeChannel()
        self.rpc = _Client(fails=False)

    def client(self) -> _Client:
        return self.rpc


def test_an_abort_whose_peer_channel_closes_under_it_goes_over_the_rpc() -> None:
    from typing import Any

    from kvbeam.server.peer_rpc import GrpcDecodePeers

    none: Any = None
    local: Any = type("Local", (), {"instance_id": "p1"})()
    peers = GrpcDecodePeers(lambda: local, transport=none, dial=none, metrics=none)
    conn: Any = _ChannelConn()
    assert peers.abort(conn, "decode:1", "qperr-1", "prefill failed", timeout=1.0) is True
    assert conn.channel.calls == 1 and conn.rpc.stub.Abort.calls == 1
