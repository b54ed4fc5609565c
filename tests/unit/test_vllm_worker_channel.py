"""The vLLM connector's worker side over the engine channel, without vLLM or a daemon.

The worker's attachment is a real :class:`~kvbeam.engine.channel.EngineChannel` on one
end of a socketpair; the test plays the daemon on the other end: it reads the frames
the worker wrote for a step and pushes states back.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbeam.engine import EnginePools, attach
from kvbeam.engine.attach import Reattach
from kvbeam.engine.channel import EngineChannel
from kvbeam.errors import KvbeamError
from kvbeam.integrations.vllm import params as P
from kvbeam.integrations.vllm import scheduler as S
from kvbeam.integrations.vllm.worker import WorkerSide
from kvbeam.pools.types import IndexKind
from kvbeam.proto import engine_frames as ef
from kvbeam.states import FailureReason, TransferState
from tests.fixtures import side
from tests.unit.test_engine_reattach import FakeDaemon
from tests.waiting import wait_until

SETTINGS = P.Settings(daemons=("127.0.0.1:7",), attach_sockets=("/x.sock",), model="m")


class _Attachment:
    def __init__(self, channel: EngineChannel) -> None:
        self.channel = channel
        self.reattaching = False

    def close(self) -> None:
        self.channel.close()


def _frames(sock: socket.socket, n: int) -> list[Any]:
    buf = ef.FrameBuffer()
    out: list[bytes] = []
    sock.settimeout(5)
    while len(out) < n:
        out += buf.feed(sock.recv(65536))
    return [ef.decode(b) for b in out]


def _finished(worker: WorkerSide, want: tuple[set[str], set[str]]) -> tuple[set[str], set[str]]:
    sent: set[str] = set()
    received: set[str] = set()
    deadline = time.monotonic() + 5
    while (sent, received) != want and time.monotonic() < deadline:
        s, r = worker.get_finished()
        sent |= s
        received |= r
        time.sleep(0.01)
    return sent, received


def test_a_step_reserves_and_sends_in_one_write_and_pushed_states_finish_them() -> None:
    engine, daemon = socket.socketpair()
    worker = WorkerSide(SETTINGS, block_size=32, num_kv_heads=2, head_size=32)
    worker.attachment = _Attachment(EngineChannel(engine, "test"))  # type: ignore[assignment]
    worker.absorb(S.StepPlan(loads=[S.Load("b", "t2", (7, 3), ("p:1",), 45),
                                    S.Load("c", "t3", (4,), ("p:1",), 20)],
                             sends=[S.Push("a", "t1", (5, 9, 2), ("d:1",), 70)]))
    reserve2, _reserve3, send = _frames(daemon, 3)  # the step's batch
    assert isinstance(reserve2, ef.Reserve) and isinstance(send, ef.Send)
    assert (reserve2.request_id, reserve2.seq_len, reserve2.prefill_address) == ("t2", 45, "p:1")
    assert np.array_equal(reserve2.indices[IndexKind.KV_PAGES], [7, 3])
    assert (send.request_id, send.seq_len, send.decode_address, send.final) == (
        "t1", 70, "d:1", True)
    assert np.array_equal((send.indices or {})[IndexKind.KV_PAGES], [5, 9, 2])
    assert worker.get_finished() == (set(), set())  # nothing pushed yet: nothing ended
    daemon.sendall(ef.encode(ef.State("t2", TransferState.SUCCESS, None, 3, "ok"))
                   + ef.encode(ef.State("t1", TransferState.SUCCESS, None, 3, "ok"))
                   + ef.encode(ef.Error("t3", "reserve", "NoFreeSlot: full"))
                   # the daemon holds nothing of a refused reservation: it pushes Failed
                   + ef.encode(ef.State("t3", TransferState.FAILED,
                                        FailureReason.INVALID_REQUEST, 0,
                                        "reserve: NoFreeSlot: full")))
    assert _finished(worker, ({"a"}, {"b", "c"})) == ({"a"}, {"b", "c"})
    assert worker.take_load_errors() == {4}  # the refused reservation's block
    (release,) = _frames(daemon, 1)  # the landed request is released
    assert isinstance(release, ef.Release) and release.request_id == "t2"
    worker.close()
    daemon.close()


def test_a_dropped_daemon_socket_fails_the_loads_as_load_errors() -> None:
    engine, daemon = socket.socketpair()
    worker = WorkerSide(SETTINGS, block_size=32, num_kv_heads=2, head_size=32)
    channel = EngineChannel(engine, "test")
    worker.attachment = _Attachment(channel)  # type: ignore[assignment]
    worker.absorb(S.StepPlan(loads=[S.Load("b", "t2", (7, 3), ("p:1",), 45)]))
    _frames(daemon, 1)
    daemon.close()  # the daemon went away
    assert _finished(worker, (set(), {"b"})) == (set(), {"b"})
    assert worker.take_load_errors() == {7, 3}
    assert channel.closed_reason.endswith("closed the attach socket")
    worker.close()


TP2 = P.Settings(daemons=("127.0.0.1:7", "127.0.0.1:8"), attach_sockets=("/a.sock", "/b.sock"),
                 model="m")


def test_a_tp1_prefill_sends_one_transfer_per_decode_rank_and_ends_when_all_did() -> None:
    engine, daemon = socket.socketpair()
    worker = WorkerSide(SETTINGS, block_size=32, num_kv_heads=2, head_size=32)
    worker.attachment = _Attachment(EngineChannel(engine, "test"))  # type: ignore[assignment]
    worker.absorb(S.StepPlan(sends=[S.Push("a", "t1", (5, 9), ("d:1", "d:2"), 40)]))
    sends = _frames(daemon, 2)
    assert [(s.request_id, s.decode_address) for s in sends] == [("t1.r0", "d:1"),
                                                                ("t1.r1", "d:2")]
    assert all(np.array_equal((s.indices or {})[IndexKind.KV_PAGES], [5, 9]) for s in sends)
    daemon.sendall(ef.encode(ef.State("t1.r0", TransferState.SUCCESS, None, 3, "ok")))
    time.sleep(0.2)
    assert worker.get_finished() == (set(), set())  # one of its two transfers ended
    daemon.sendall(ef.encode(ef.State("t1.r1", TransferState.FAILED, None, 3, "x")))
    assert _finished(worker, ({"a"}, set())) == ({"a"}, set())
    worker.close()
    daemon.close()


def test_each_decode_rank_reserves_its_own_transfer_on_its_own_daemon() -> None:
    for rank in (0, 1):
        worker = WorkerSide(TP2, block_size=32, num_kv_heads=1, head_size=32, tp_rank=rank,
                            tp_size=2)
        assert worker.attach_socket == TP2.attach_sockets[rank]
        engine, daemon = socket.socketpair()
        worker.attachment = _Attachment(EngineChannel(engine, "test"))  # type: ignore[assignment]
        worker.absorb(S.StepPlan(loads=[S.Load("b", "t2", (7, 3), ("p:1",), 45)],
                                 declines=[S.Decline("c", "t3", ("p:1",), "no")]))
        reserve, decline = _frames(daemon, 2)
        assert isinstance(reserve, ef.Reserve) and isinstance(decline, ef.Decline)
        assert (reserve.request_id, reserve.prefill_address) == (f"t2.r{rank}", "p:1")
        assert decline.request_id == f"t3.r{rank}"
        worker.close()
        daemon.close()


def test_a_send_naming_no_decode_goes_out_with_an_empty_decode_address() -> None:
    """Prefill named no decode (vLLM's NIXL contract): each rank's share is one SEND of
    its own rank's transfer id, decode address empty (the daemon waits for the Offer of
    the decode that reserves it)."""
    for settings, rank, tp, want in ((SETTINGS, 0, 1, "t1"), (TP2, 1, 2, "t1.r1")):
        engine, daemon = socket.socketpair()
        worker = WorkerSide(settings, block_size=32, num_kv_heads=2 // tp, head_size=32,
                            tp_rank=rank, tp_size=tp)
        worker.attachment = _Attachment(EngineChannel(engine, "test"))  # type: ignore[assignment]
        worker.absorb(S.StepPlan(sends=[S.Push("a", "t1", (5, 9), (), 40)]))
        (send,) = _frames(daemon, 1)
        assert isinstance(send, ef.Send)
        assert (send.request_id, send.decode_address) == (want, "")
        worker.close()
        daemon.close()


def test_the_worker_reports_a_detach_once_and_a_refused_decode_daemon() -> None:
    """What the scheduler side hears (vLLM's connector worker metadata): the attachment
    going (once), a named decode daemon a send to which could not happen (the pair's
    handshake refused); nothing when nothing changed."""
    engine, daemon = socket.socketpair()
    worker = WorkerSide(SETTINGS, block_size=32, num_kv_heads=2, head_size=32)
    channel = EngineChannel(engine, "test")
    att = _Attachment(channel)
    worker.attachment = att  # type: ignore[assignment]
    assert worker.report() is None  # attached, nothing new
    worker.absorb(S.StepPlan(sends=[S.Push("a", "t1", (5, 9), ("d:1",), 40)]))
    _frames(daemon, 1)
    daemon.sendall(ef.encode(ef.State("t1", TransferState.FAILED, FailureReason.INCOMPATIBLE,
                                      3, "block size: prefill=32, decode=64")))
    assert _finished(worker, ({"a"}, set())) == ({"a"}, set())
    report = worker.report()
    assert report is not None and report.detached is None
    assert report.refused == {"d:1": "incompatible: block size: prefill=32, decode=64"}
    assert worker.take_counts() == {"send_failed_incompatible": 1}
    assert worker.report() is None
    # An unreachable decode daemon is not held against it: it may be back next request.
    worker.absorb(S.StepPlan(sends=[S.Push("b", "t2", (5,), ("d:2",), 20)]))
    _frames(daemon, 1)
    daemon.sendall(ef.encode(ef.State("t2", TransferState.FAILED,
                                      FailureReason.PEER_UNREACHABLE, 3, "refused")))
    assert _finished(worker, ({"b"}, set())) == ({"b"}, set())
    assert worker.report() is None
    daemon.close()  # the daemon went away
    deadline = time.monotonic() + 5
    while not channel.closed_reason and time.monotonic() < deadline:
        time.sleep(0.01)
    # Re-attaching (the daemon may be back at the next request): not reported gone.
    att.reattaching = True
    assert worker.report() is None
    att.reattaching = False  # gave up
    report = worker.report()
    assert report is not None and report.detached and "closed the attach socket" in \
        report.detached
    assert worker.report() is None  # said once
    worker.close()


def test_the_pool_description_is_read_from_the_live_kv_cache() -> None:
    """Heads, tokens per block, head size and layout come from the cache tensor (vLLM
    CPU's [blocks, heads, tokens, K and V], strides LBHNC), checked against vLLM's
    config: a config that disagrees is refused naming both values."""
    import torch  # only here: the other tests need no torch

    view = torch.zeros(8, 2, 32, 64)
    worker = WorkerSide(SETTINGS, block_size=32, num_kv_heads=2, head_size=32)
    assert tuple(worker._live_geometry("l0", view)) == (2, 32, 32, "LBHNC")
    nhc = torch.zeros(8, 32, 2, 64).transpose(1, 2)  # tokens outside heads: LBNHC
    named = P.Settings(daemons=("h:1",), attach_sockets=("/s",), model="m",
                       inner_layout="LBHNC")
    with pytest.raises(KvbeamError, match="inner_layout: cache LBNHC, config LBHNC"):
        WorkerSide(named, block_size=32, num_kv_heads=2, head_size=32)._live_geometry(
            "l0", nhc)
    with pytest.raises(KvbeamError, match="block_size: cache 32, config 64"):
        WorkerSide(SETTINGS, block_size=64, num_kv_heads=2, head_size=32)._live_geometry(
            "l0", view)
    with pytest.raises(KvbeamError, match=r"shape \(8, 64\)"):
        worker._live_geometry("l0", torch.zeros(8, 64))

def test_while_its_daemon_is_away_loads_and_sends_fail_at_once_then_use_the_new_channel(
        tmp_path: Path) -> None:
    """The worker's attachment re-attaches (a real Attachment against a fake daemon): in
    between, a step's loads end at once as load errors and its sends at once, saying the
    daemon is unreachable; after, the next step's frames go to the new channel."""
    sock = str(tmp_path / "d.sock")
    daemon = FakeDaemon(sock, [])
    worker = WorkerSide(SETTINGS, block_size=32, num_kv_heads=2, head_size=32)
    with EnginePools(side()) as pools:
        worker.attachment = attach(sock, pools, reattach=Reattach(0.05, 0.05, timeout_s=5))
        daemon.refusing = True  # until the step below ran
        daemon.drop()
        assert wait_until(lambda: worker.attachment is not None and worker.attachment.reattaching,
                          10.0, 0.01)
        worker.absorb(S.StepPlan(loads=[S.Load("b", "t2", (7, 3), ("p:1",), 45)],
                                 sends=[S.Push("a", "t1", (5,), ("d:1",), 20)]))
        assert worker.get_finished() == ({"a"}, {"b"})  # the same step: no wait
        assert worker.take_load_errors() == {7, 3}
        daemon.refusing = False
        assert wait_until(lambda: worker.attachment is not None
                          and worker.attachment.reattaches == 1, 10.0, 0.01)
        worker.absorb(S.StepPlan(loads=[S.Load("c", "t3", (4,), ("p:1",), 20)]))
        (reserve,) = daemon.frames(daemon.attached[-1], 1)
        assert isinstance(reserve, ef.Reserve) and reserve.request_id == "t3"
        assert worker.get_finished() == (set(), set())  # in flight on the new channel
        worker.close()
    daemon.close()




def _layered_worker() -> tuple[WorkerSide, socket.socket]:
    """A worker on a socketpair whose attached cache has three layers (as
    register_kv_caches names them from vLLM's ``kv_caches``)."""
    engine, daemon = socket.socketpair()
    worker = WorkerSide(SETTINGS, block_size=32, num_kv_heads=2, head_size=32)
    worker.attachment = _Attachment(EngineChannel(engine, "test"))  # type: ignore[assignment]
    worker._layer_of = {"l0": 0, "l1": 1, "l2": 2}
    return worker, daemon


def test_a_streamed_prompt_goes_a_frame_per_layer_and_ends_after_vllms_end() -> None:
    """Layer by layer: the step's stream sends nothing before its first layer; each
    layer's frame names the layers ready (its blocks with the first); the last layer's
    is final. Its Success is reported only once vLLM ended the request (its send in
    the next step's plan): vLLM frees the blocks of a send reported ended."""
    worker, daemon = _layered_worker()
    push = S.Push("a", "t1", (5, 9), ("d:1",), 40)
    worker.absorb(S.StepPlan(streams=[push]))
    worker.save_layer("l0")
    first = _frames(daemon, 1)[0]
    assert isinstance(first, ef.Send)
    assert (first.request_id, first.kv_offset, first.layers, first.final) == ("t1", 0, 1, False)
    assert np.array_equal((first.indices or {})[IndexKind.KV_PAGES], [5, 9])
    worker.save_layer("l1")
    worker.save_layer("l1")  # again (a second forward of the step): nothing new
    worker.save_layer("l2")
    second, last = _frames(daemon, 2)
    assert (second.kv_offset, second.layers, second.final) == (2, 2, False)
    assert not len((second.indices or {}).get(IndexKind.KV_PAGES, []))  # no new blocks
    assert (last.kv_offset, last.layers, last.final) == (2, None, True)
    worker.forward_done()  # every stream went final at its last layer: nothing more
    daemon.sendall(ef.encode(ef.State("t1", TransferState.SUCCESS, None, 3, "ok")))
    time.sleep(0.2)
    assert worker.get_finished() == (set(), set()), "reported before vLLM ended it"
    worker.absorb(S.StepPlan(sends=[push]))  # vLLM's end: no second send
    assert _finished(worker, ({"a"}, set())) == ({"a"}, set())
    daemon.settimeout(0.2)
    with pytest.raises(TimeoutError):
        daemon.recv(1)
    worker.close()
    daemon.close()


def test_a_cancelled_stream_is_aborted_and_ends_with_its_failure() -> None:
    worker, daemon = _layered_worker()
    worker.absorb(S.StepPlan(streams=[S.Push("a", "t1", (5,), ("d:1",), 20)]))
    worker.save_layer("l0")
    _frames(daemon, 1)
    worker.absorb(S.StepPlan(cancels=["a", "never-streamed"]))
    (abort,) = _frames(daemon, 1)
    assert isinstance(abort, ef.Abort) and abort.request_id == "t1"
    worker.save_layer("l1")  # no longer streamed: nothing
    assert _finished(worker, ({"never-streamed"}, set())) == ({"never-streamed"}, set())
    daemon.sendall(ef.encode(ef.State("t1", TransferState.FAILED, FailureReason.ABORTED, 3,
                                      "aborted")))
    assert _finished(worker, ({"a"}, set())) == ({"a"}, set())
    worker.close()
    daemon.close()


def test_a_stream_whose_channel_went_ends_failed_at_vllms_end_not_never() -> None:
    """No engine channel at the step's end: nothing of the stream can go; it ends
    (failed, counted) once vLLM ended the request, so vLLM frees its blocks."""
    worker, daemon = _layered_worker()
    push = S.Push("a", "t1", (5,), ("d:1",), 20)
    worker.absorb(S.StepPlan(streams=[push]))
    attachment = worker.attachment
    worker.attachment = None
    worker.forward_done()
    worker.attachment = attachment
    worker.absorb(S.StepPlan(sends=[push]))
    assert _finished(worker, ({"a"}, set())) == ({"a"}, set())
    assert worker.take_counts().get("send_failed_detached") == 1
    worker.close()
    daemon.close()
