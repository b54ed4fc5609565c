"""The first request after decode's engine re-attached succeeds (real processes, TCP).

Decode's daemon gets a new instance id when its engine re-attaches; prefill learns it
only at its next heartbeat (or when the data link closes). A request sent before
that meets a BeginWrite refusal on the stale connection, before any byte of it was
written: prefill handshakes again and goes on, so the scheduler sees a Success, not
"decode ... restarted".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from kvbeam.states import VERIFIED_PREFIX, TransferState
from tests.attach_helpers import Engine, start_engine_daemon, write_config
from tests.fixtures import side
from tests.waiting import wait_until

SEQ = 700


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess, Engine, Engine]]:
    """(prefill, decode, prefill engine, decode engine), both engines attached."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    psock, dsock = str(tmp_path / "p.sock"), str(tmp_path / "d.sock")
    # Slow heartbeats: prefill must not learn of the re-attach before the request.
    extra = ["--heartbeat-s", "30"]
    d = start_engine_daemon("decode", dsock, extra=extra)
    p = start_engine_daemon("prefill", psock, extra=extra)
    pe = Engine(psock, cfg, seed=1)
    de = Engine(dsock, cfg, seed=2)
    try:
        assert pe.attached and de.attached, (pe.first, de.first)
        yield p, d, pe, de
    finally:
        for stop in (pe.stop, de.stop, p.stop, d.stop):
            stop()


def _move(p: KvbeamClient, d: KvbeamClient, rid: str, slot: int) -> None:
    d.reserve(rid, SEQ, p.address)
    p.send(rid, slot, SEQ, d.address)
    for c in (p, d):
        st = c.wait(rid, 60)
        assert st.state is TransferState.SUCCESS, (rid, str(st))
        assert c is p or st.detail.startswith(VERIFIED_PREFIX), st.detail
    d.release(rid)


def test_first_request_after_a_decode_reattach_succeeds(pair: tuple[
        DaemonProcess, DaemonProcess, Engine, Engine]) -> None:
    prefill, decode, _pe, de = pair
    with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
        assert p.wait_healthy(10) and d.wait_healthy(10)
        _move(p, d, "before", 0)  # prefill now holds a connection to decode's instance
        assert de.cmd("detach") == "detached"
        assert wait_until(lambda: not d.healthy(1.0), 10)
        assert de.cmd("attach").startswith("attached ")
        assert d.wait_healthy(10)
        # At once, not waiting for prefill to drop the old instance's connection (over
        # TCP it usually has, when decode's detach closed the data link; an idle RC QP
        # gives no such sign, and the request then handshakes again: the unit tests
        # in tests/unit/test_core_reattach.py hold that path).
        _move(p, d, "first-after", 1)
        # (Decode's reservation may ask prefill to connect to its new instance first:
        # then prefill's log names the request nowhere.)
        assert "failed" not in prefill.output.partition("first-after")[2], prefill.output
        assert prefill.output.count("handshaking again") <= 1
        _move(p, d, "second-after", 2)


def test_one_instance_id_until_an_engine_attaches_new_memory(pair: tuple[
        DaemonProcess, DaemonProcess, Engine, Engine]) -> None:
    """The id a daemon prints when it starts is the one its first attach answers and its
    peers handshake with (before, the first attach made a new one); an attach after a
    detach is new memory, so a new id, logged with both."""
    prefill, decode, pe, de = pair
    assert pe.first == f"attached {prefill.instance_id}"
    assert de.first == f"attached {decode.instance_id}"
    with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
        assert p.wait_healthy(10) and d.wait_healthy(10)
        assert d.capacity().instance_id == decode.instance_id  # what its Heartbeat says
        _move(p, d, "one", 0)
        assert f"decode peer {decode.instance_id} at " in prefill.output, prefill.output
        assert de.cmd("detach") == "detached"
        assert wait_until(lambda: not d.healthy(1.0), 10)
        again = de.cmd("attach")
        new = again.removeprefix("attached ")
        assert again.startswith("attached ") and new != decode.instance_id, again
        assert d.wait_healthy(10) and d.capacity().instance_id == new
        assert wait_until(lambda: f"instance id {decode.instance_id} -> {new}: an engine "
                                  "attached new memory after a detach" in decode.output, 10), \
            decode.output
