"""Engines attach their own memory to ``--pools engine`` daemons (real processes, TCP).

A prefill and a decode daemon start without pools (NOT_SERVING, transfers refused
FAILED_PRECONDITION with the socket named); two engine processes (tests/engine_peer.py)
allocate memfd pools, fill them with different patterns and attach; a request moves
and the decode ENGINE reads prefill's bytes in its own memory. Then detach and
re-attach without restarting the daemons, and a request succeeds again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbeam.client import KvbeamClient
from kvbeam.errors import NoEngineAttached
from kvbeam.pools.layout import build_side_layout
from kvbeam.procs import DaemonProcess
from kvbeam.states import VERIFIED_PREFIX, TransferState
from tests.attach_helpers import Engine, start_engine_pair, write_config
from tests.engine_lists import as_mapping, random_lists
from tests.fixtures import side
from tests.waiting import wait_until

SEQ = 700  # 3 pages of 256: not on a page boundary


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    tmp_path.chmod(0o700)
    return tmp_path


@pytest.fixture
def pair(workdir: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess, str, str, str]]:
    """(prefill, decode, prefill socket, decode socket, config path); no engines yet."""
    cfg = write_config(workdir / "side.yaml", side())
    psock, dsock = str(workdir / "p.sock"), str(workdir / "d.sock")
    p, d = start_engine_pair(psock, dsock)
    try:
        yield p, d, psock, dsock, cfg
    finally:
        p.stop()
        d.stop()


def _move(p: KvbeamClient, d: KvbeamClient, rid: str, src_slot: int, paddr: str,
          daddr: str) -> int:
    res = d.reserve(rid, SEQ, paddr)
    p.send(rid, src_slot, SEQ, daddr)
    for c in (p, d):
        st = c.wait(rid, 60)
        assert st.state is TransferState.SUCCESS, (rid, str(st))
    d.release(rid)
    return res.slot


def test_engine_pair_moves_requests_into_the_decode_engines_memory(pair: tuple[
        DaemonProcess, DaemonProcess, str, str, str]) -> None:
    prefill, decode, psock, dsock, cfg = pair
    with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
        # Before any engine: NOT_SERVING, transfers refused naming the socket.
        assert not p.healthy(2.0) and not d.healthy(2.0)
        with pytest.raises(NoEngineAttached, match=f"no engine attached: .*--pools engine.*"
                                                   f"{dsock}"):
            d.reserve("early", SEQ, prefill.address)
        with pytest.raises(NoEngineAttached, match=psock):
            p.send("early", 0, SEQ, decode.address)
        # The prefill engine brings its own allocation (one memfd, its own offsets).
        pe = Engine(psock, cfg, seed=1, layout="packed")
        de = Engine(dsock, cfg, seed=2)
        try:
            assert pe.attached and de.attached, (pe.first, de.first)
            assert p.wait_healthy(10) and d.wait_healthy(10)
            before = de.digests(0, SEQ)
            slot = _move(p, d, "r1", 0, prefill.address, decode.address)
            landed = de.digests(slot, SEQ)
            assert landed == pe.digests(0, SEQ)
            assert landed != before  # the decode engine's memory changed

            # Decode's engine detaches: NOT_SERVING, refused; re-attaches: serves again.
            assert de.cmd("detach") == "detached"
            assert wait_until(lambda: not d.healthy(1.0), 10)
            with pytest.raises(NoEngineAttached, match=r"last: engine .* detached"):
                d.reserve("between", SEQ, prefill.address)
            answer = de.cmd("attach")
            assert answer.startswith("attached ") and answer.split()[1] != de.first.split()[1]
            assert d.wait_healthy(10)
            # At once: a connection to the old instance prefill still holds is
            # replaced by a new handshake (tests/host/test_reattach.py).
            slot = _move(p, d, "r2", 1, prefill.address, decode.address)
            assert de.digests(slot, SEQ) == pe.digests(1, SEQ) != pe.digests(0, SEQ)

            # The prefill engine restarts (a new process): the pair serves again.
            pe.stop()
            assert wait_until(lambda: not p.healthy(1.0), 10)
            pe = Engine(psock, cfg, seed=3, layout="packed")
            assert pe.attached and p.wait_healthy(10)
            slot = _move(p, d, "r3", 2, prefill.address, decode.address)
            assert de.digests(slot, SEQ) == pe.digests(2, SEQ)
            # Engine-chosen (shuffled, fragmented) lists over attached memory, verified
            # by decode's digests of ITS lists against prefill's of ITS lists.
            cfg_obj, lay = side(), build_side_layout(side())
            rng = np.random.default_rng(5)
            src, dst = (as_mapping(random_lists(cfg_obj.target, lay, SEQ, rng))
                        for _ in range(2))
            d.reserve("r4", SEQ, prefill.address, indices=dst)
            p.send("r4", -1, SEQ, decode.address, indices=src)
            done = d.wait("r4", 60)
            assert done.state is TransferState.SUCCESS, str(done)
            assert done.detail.startswith(VERIFIED_PREFIX), done.detail
        finally:
            pe.stop()
            de.stop()
    for daemon in (prefill, decode):
        assert daemon.proc.poll() is None, daemon.output
    assert os.path.exists(dsock)
