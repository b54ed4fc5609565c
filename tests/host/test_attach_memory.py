"""Engine memory an engine could pull from under its daemon (real processes, TCP).

The reproduction of issue 22: two ``--pools engine`` daemons, engines attached through
:mod:`kvbeam.engine`, then the prefill engine ``ftruncate``\\ s its memfds to 0 and a
request is sent. Unsealed, the prefill daemon died of SIGBUS reading the source; the
memfds are now sealed against shrinking and growing, so the engine's ``ftruncate`` fails
with EPERM and the request moves (likewise for decode's engine, for growing, and after
the engines closed their fds). Punching a hole (which size seals do not block) zeroes
the pages for everybody, and nothing crashes. A memfd without the seals, a tmpfs file
(which cannot carry seals) and a file on a disk filesystem are refused at attach, naming
the fd, the buffer and the fix.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.engine import AttachError, EnginePools, attach
from kvbeam.errors import KvbeamError
from kvbeam.procs import DaemonProcess
from kvbeam.states import TransferState
from tests.attach_helpers import Engine, start_engine_daemon, start_engine_pair, write_config
from tests.fixtures import side
from tests.waiting import wait_until

SEQ = 700
REPO = Path(__file__).resolve().parents[2]


@dataclass
class EnginePair:
    prefill: DaemonProcess
    decode: DaemonProcess
    pe: Engine
    de: Engine


@pytest.fixture
def engine_pair(tmp_path: Path) -> Iterator[EnginePair]:
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    psock, dsock = str(tmp_path / "p.sock"), str(tmp_path / "d.sock")
    prefill, decode = start_engine_pair(psock, dsock)
    engines: list[Engine] = []
    try:
        engines += [Engine(psock, cfg, seed=1), Engine(dsock, cfg, seed=2)]
        assert all(e.attached for e in engines), [e.first for e in engines]
        yield EnginePair(prefill, decode, *engines)
    finally:
        for e in engines:
            e.stop()
        prefill.stop()
        decode.stop()


def _both_alive(pair: EnginePair, settle_s: float = 0.0) -> None:
    for daemon in (pair.prefill, pair.decode):
        if settle_s:  # a daemon killed by a signal may still be exiting
            wait_until(lambda d=daemon: d.proc.poll() is not None, settle_s)
        assert daemon.proc.poll() is None, (
            f"{daemon.role} daemon died (exit {daemon.proc.poll()}): {daemon.output[-2000:]}")


def _move(pair: EnginePair, rid: str) -> int:
    """Move one request (prefill slot 0) into the decode engine; decode's slot."""
    with KvbeamClient(pair.prefill.address) as p, KvbeamClient(pair.decode.address) as d:
        res = d.reserve(rid, SEQ, pair.prefill.address)
        p.send(rid, 0, SEQ, pair.decode.address)
        for c in (p, d):
            try:
                st = c.wait(rid, 60)
            except KvbeamError:  # say first when it is because a daemon died
                _both_alive(pair, 3.0)
                raise
            _both_alive(pair, 0.0 if st.state is TransferState.SUCCESS else 3.0)
            assert st.state is TransferState.SUCCESS, (rid, str(st))
        d.release(rid)
    return res.slot


def test_an_engine_that_truncates_its_memory_cannot_kill_its_daemon(
        engine_pair: EnginePair) -> None:
    pair = engine_pair
    # The reproduction: the prefill engine shrinks its memfds to nothing.
    shrink = pair.pe.cmd("resize 0")
    slot = _move(pair, "prefill-truncated")
    assert shrink == "resize refused: EPERM"
    assert pair.de.digests(slot, SEQ) == pair.pe.digests(0, SEQ)
    # The decode engine (the daemon writes its landings there), and growing.
    answers = [pair.de.cmd("resize 0"), pair.pe.cmd(f"resize {1 << 30}"),
               pair.de.cmd(f"resize {1 << 30}")]
    slot = _move(pair, "decode-truncated")
    assert answers == ["resize refused: EPERM"] * 3
    assert pair.de.digests(slot, SEQ) == pair.pe.digests(0, SEQ)
    # Closing its fds takes nothing from a daemon: its mappings hold the memory.
    assert pair.pe.cmd("close-fds") == pair.de.cmd("close-fds") == "closed"
    slot = _move(pair, "fds-closed")
    assert pair.de.digests(slot, SEQ) == pair.pe.digests(0, SEQ)


def test_punching_holes_in_attached_memory_zeroes_it_and_crashes_nothing(
        engine_pair: EnginePair) -> None:
    pair = engine_pair
    before = pair.pe.digests(0, SEQ)
    # Size seals do not stop FALLOC_FL_PUNCH_HOLE: the pages are freed, every mapping
    # (the daemon's too) reads zeros there, and a write allocates a fresh page.
    assert pair.pe.cmd("punch") == "punched"
    assert pair.de.cmd("punch") == "punched"
    zeros = pair.pe.digests(0, SEQ)
    assert zeros != before
    slot = _move(pair, "after-punch")  # prefill reads holes; decode writes into holes
    assert pair.de.digests(slot, SEQ) == zeros
    _both_alive(pair)


def _unsealed_memfd(nbytes: int) -> int:
    fd = os.memfd_create("kvbeam.unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd


def _shrink_sealed_memfd(nbytes: int) -> int:
    fd = os.memfd_create("kvbeam.half-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # growing is still allowed
    return fd


def _tmpfs_file(nbytes: int) -> int:
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    return fd


def _disk_file(nbytes: int) -> int:
    fd = os.open(REPO, os.O_TMPFILE | os.O_RDWR, 0o600)  # the checkout's filesystem
    os.ftruncate(fd, nbytes)
    return fd


def test_memory_that_can_change_size_or_is_not_shared_memory_is_refused_at_attach(
        tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    sock = str(tmp_path / "d.sock")
    assert os.statvfs(REPO).f_fsid != os.statvfs("/dev/shm").f_fsid
    decode = start_engine_daemon("decode", sock)
    refused: dict[str, AttachError] = {}
    try:
        with EnginePools(side()) as pools:
            first = pools.layout.components[0].buffers[0]
            nbytes = os.fstat(pools.fds[first.tensor]).st_size
            for name, make in (("unsealed memfd", _unsealed_memfd),
                               ("memfd sealed against shrinking only", _shrink_sealed_memfd),
                               ("tmpfs file", _tmpfs_file), ("disk file", _disk_file)):
                buffers = pools.buffers()
                fd = make(nbytes)
                buffers.fds[first.tensor] = fd
                try:
                    with attach(sock, buffers, pools.config):
                        pass
                except AttachError as exc:
                    refused[name] = exc
                finally:
                    os.close(fd)
            # The same pools, sealed: attached (the refusals were the fd's, nothing else).
            with attach(sock, pools) as att:
                assert att.instance_id
    finally:
        decode.stop()
    assert set(refused) == {"unsealed memfd", "memfd sealed against shrinking only",
                            "tmpfs file", "disk file"}, refused
    where = f"fds[{first.tensor}] (components[0][0] {first.name}"
    for name, error in refused.items():
        print(f"\n{name}: {error}")
        assert error.field == f"fds[{first.tensor}]", (name, error.field)
        assert where in str(error), (name, str(error))
    for name in ("unsealed memfd", "memfd sealed against shrinking only", "tmpfs file"):
        assert "not sealed against resizing" in str(refused[name]), refused[name]
        assert "MFD_ALLOW_SEALING" in str(refused[name])
    assert "F_SEAL_SHRINK" in str(refused["unsealed memfd"])
    assert "not shared memory" in str(refused["disk file"])
    assert "tmpfs or hugetlbfs" in str(refused["disk file"])
    assert "kvbeam.pools.shm.create_memfd" in str(refused["disk file"])
