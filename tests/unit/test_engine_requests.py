"""kvbeam.engine.requests: sglang's KVPoll; no gRPC, no torch (Sender and Receiver over the
engine channel: tests/unit/test_engine_channel.py)."""

from __future__ import annotations

import subprocess
import sys

from kvbeam.engine.requests import KVPoll, poll_of
from kvbeam.states import TransferState


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
