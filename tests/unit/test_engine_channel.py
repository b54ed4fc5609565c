"""The engine's end of the engine channel, against a fake daemon on a socketpair."""

from __future__ import annotations

import socket

from kvbeam.engine import KVPoll, Receiver, Sender
from kvbeam.engine.channel import EngineChannel
from kvbeam.proto import engine_frames as ef
from kvbeam.states import FailureReason, TransferState
from tests.waiting import wait_until


def test_pushed_states_are_read_locally_and_all_at_once() -> None:
    engine, daemon = socket.socketpair()
    channel = EngineChannel(engine, "fake.sock")
    s = Sender(channel, "a", "d:1")
    r = Receiver(channel, "b", "p:1")
    assert s.poll() is KVPoll.Bootstrapping  # before any call: nothing asked
    with channel.batch():
        s.send([1, 2], seq_len=100)
        r.send_metadata([3, 4], seq_len=100)
    daemon.settimeout(5)
    got = ef.FrameBuffer().feed(daemon.recv(65536))  # the batch: one write
    assert [type(ef.decode(b)).__name__ for b in got] == ["Send", "Reserve"]
    daemon.sendall(b"".join(ef.encode(f) for f in (
        ef.State("a", TransferState.BOOTSTRAPPING, None, 0, ""),
        ef.State("a", TransferState.TRANSFERRING, None, 2, ""),
        ef.State("a", TransferState.WAITING_FOR_INPUT, None, 1, "late, ignored"),
        ef.State("b", TransferState.FAILED, FailureReason.INTEGRITY, 3, "digest 2 differs"),
        ef.State("zzz", TransferState.SUCCESS, None, 9, "not ours: ignored"))))
    assert r.wait(5) is KVPoll.Failed
    assert wait_until(lambda: s.poll() is KVPoll.Transferring, 5.0, 0.005)
    events = channel.poll_many()
    assert [(e.request_id, e.state.value) for e in events] == [
        ("a", "Bootstrapping"), ("a", "Transferring"), ("b", "Failed")]
    assert channel.poll_many() == []
    assert r.failure() == (FailureReason.INTEGRITY, "digest 2 differs")
    daemon.sendall(ef.encode(ef.State("a", TransferState.SUCCESS, None, 4, "")))
    assert next(channel.events(timeout=5)).state is TransferState.SUCCESS
    assert s.poll() is KVPoll.Success
    channel.close()
    daemon.close()


def test_a_closed_daemon_socket_fails_what_is_in_flight() -> None:
    engine, daemon = socket.socketpair()
    channel = EngineChannel(engine, "fake.sock")
    s = Sender(channel, "a", "d:1")
    s.send([1], seq_len=10)
    daemon.close()
    assert s.wait(5) is KVPoll.Failed
    reason, detail = s.failure() or (None, "")
    assert reason is FailureReason.SHUTDOWN and "the daemon on fake.sock" in detail, detail
    late = Sender(channel, "b", "d:1")  # after the close: failed at once, nothing written
    late.send([2], seq_len=10)
    assert late.poll() is KVPoll.Failed
    channel.close()


def test_a_refused_frame_is_an_error_of_that_call_not_a_state() -> None:
    """An ERROR (an early release, a second reservation of a live id) leaves the request
    as the daemon holds it: Failed would tell the engine its pages are free while prefill
    may still write them. The refusal is readable; Failed comes only from the daemon."""
    engine, daemon = socket.socketpair()
    channel = EngineChannel(engine, "fake.sock")
    r = Receiver(channel, "live", "p:1")
    r.send_metadata([3, 4], seq_len=100)
    again = Receiver(channel, "live", "p:1")  # the same id, reserved a second time
    again.send_metadata([5, 6], seq_len=100)
    r.release()  # before Success: refused by the daemon
    daemon.sendall(ef.encode(ef.State("live", TransferState.TRANSFERRING, None, 2, ""))
                   + ef.encode(ef.Error("live", "request_id", "DuplicateRequest: known"))
                   + ef.encode(ef.Error("live", "release", "not Success yet")))
    assert wait_until(lambda: r.refusal == "release: not Success yet", 5.0, 0.005)
    assert r.poll() is KVPoll.Transferring and again.poll() is KVPoll.Transferring
    assert r.failure() is None
    r.failure_exception()  # not failed: nothing to raise
    # The daemon ends a request it holds nothing of (a RESERVE refused outright) itself.
    gone = Receiver(channel, "gone", "p:1")
    gone.send_metadata([7], seq_len=10)
    daemon.sendall(ef.encode(ef.Error("gone", "prefill_address", "bad"))
                   + ef.encode(ef.State("gone", TransferState.FAILED,
                                        FailureReason.INVALID_REQUEST, 0,
                                        "prefill_address: bad")))
    assert gone.wait(5) is KVPoll.Failed
    assert gone.refusal == "prefill_address: bad"
    assert gone.failure() == (FailureReason.INVALID_REQUEST, "prefill_address: bad")
    assert r.poll() is KVPoll.Transferring
    channel.close()
    daemon.close()
