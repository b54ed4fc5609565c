"""kvbeam.engine.requests: sglang's KVPoll, and Sender/Receiver over a recording client."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, cast

import pytest

from kvbeam.client import KvbeamClient, Status
from kvbeam.engine.requests import KVPoll, Receiver, Sender, poll_of
from kvbeam.errors import TransferFailed
from kvbeam.states import FailureReason, TransferState


def test_kvpoll_has_sglangs_integers_and_maps_every_state() -> None:
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2), ("Transferring", 3),
        ("Success", 4)]
    assert {s: poll_of(s).name for s in TransferState} == {
        TransferState.FAILED: "Failed", TransferState.BOOTSTRAPPING: "Bootstrapping",
        TransferState.WAITING_FOR_INPUT: "WaitingForInput",
        TransferState.TRANSFERRING: "Transferring", TransferState.SUCCESS: "Success"}


def test_import_pulls_in_neither_grpc_nor_torch() -> None:
    code = ("import sys, kvbeam.engine.requests; "
            "print(sorted(m for m in ('grpc', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def _status(state: TransferState, reason: FailureReason | None = None) -> Status:
    return Status("r", state, reason, "the detail", -1, 0, 0, "peer")


class Recorder:
    """A client that records each call and answers with ``state``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.state = _status(TransferState.TRANSFERRING)

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return self.state
        return call


def test_sender_sends_the_lists_with_the_first_chunk_only() -> None:
    rec = Recorder()
    s = Sender("p:1", "r", "d:2", client=cast(KvbeamClient, rec))
    assert s.poll() is KVPoll.Bootstrapping and rec.calls == []  # nothing sent yet
    with pytest.raises(ValueError, match="needs its token range"):
        s.send([1], seq_len=10, final=False)
    assert s.send([4, 2], {"REQ_SLOT": [3], "draft.SWA_RING_ROWS": [5]}, seq_len=300,
                  final=False, chunk=(0, 256)) is KVPoll.Transferring
    s.send([4, 2], {"REQ_SLOT": [3]}, seq_len=300)
    (n1, a1, k1), (n2, a2, k2) = rec.calls
    assert (n2, a2) == ("send", ("r", -1, 300, "d:2"))
    assert (n1, a1) == ("send", ("r", -1, 300, "d:2")) and k1["chunks"] == [(0, 256)]
    assert k1["indices"] == {"KV_PAGES": [4, 2], "REQ_SLOT": [3], "draft.SWA_RING_ROWS": [5]}
    assert k1["final"] is False and k2["final"] is True and k2["indices"] is None
    rec.state = _status(TransferState.FAILED, FailureReason.INTEGRITY)
    assert s.poll() is KVPoll.Failed
    with pytest.raises(TransferFailed, match="request r failed: integrity: the detail") as e:
        s.failure_exception()
    assert e.value.reason == "integrity"
    s.abort("stop")
    assert rec.calls[-1][:2] == ("abort", ("r", "stop"))


def test_receiver_reserves_at_the_engine_lists_and_releases() -> None:
    rec = Recorder()
    r = Receiver("d:2", "r", "p:1", client=cast(KvbeamClient, rec))
    r.abort()  # nothing reserved: nothing to abort
    assert rec.calls == []
    r.send_metadata([7, 1, 3], {"SWA_RING_ROWS": [9, 8]}, seq_len=600)
    assert rec.calls[0] == ("reserve", ("r", 600, "p:1"),
                            {"indices": {"KV_PAGES": [7, 1, 3], "SWA_RING_ROWS": [9, 8]},
                             "kv_skip": 0})
    rec.state = _status(TransferState.SUCCESS)
    assert r.poll() is KVPoll.Success and r.wait(1.0) is KVPoll.Success
    r.failure_exception()  # Success: nothing raised
    r.release()
    assert rec.calls[-1][:2] == ("release", ("r",))
