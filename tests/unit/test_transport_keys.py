"""Least access for registered memory, on the host: MR flags and per-link keys (fake device).

The real device runs the same paths in tests/rdma/test_memory_keys_rdma.py; here a
fake device records what would be registered, so the bookkeeping (which MR grants
what, which keys a link advertises, when they are deregistered) is checked fast.
"""

from __future__ import annotations

import itertools
import mmap
import sys
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

# pyverbs is part of `make setup`: a missing one fails here rather than skipping.
from kvbeam.procs import wait_until
from kvbeam.transport import Access, Endpoint, Event, EventKind, Region, RemoteRegion
from kvbeam.transport.tcp import TcpTransport
from kvbeam.transport.verbs import device as verbs_device
from kvbeam.transport.verbs import transport as verbs
from kvbeam.transport.verbs.qp import RECV_TAG
from tests.transport_peer import buffer_address


class FakeMR:
    """What ibv_reg_mr would return: keys and the access it grants."""

    _keys = itertools.count(0x100)

    def __init__(self, addr: int, length: int, access: Access) -> None:
        self.addr, self.length, self.access = addr, length, access
        self.lkey = self.rkey = next(self._keys)
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeDevice:
    """Records every MR; enough of VerbsDevice for the transport and links."""

    def __init__(self, name: str, gid_index: int) -> None:
        self.name, self.gid_index = name, gid_index
        self.gid, self.mtu = "fe80:0000:0000:0000:0000:0000:0000:0001", 3
        self.mrs: list[FakeMR] = []

    def register(self, addr: int, length: int, access: Access) -> FakeMR:
        mr = FakeMR(addr, length, access)
        self.mrs.append(mr)
        return mr

    def live(self) -> list[FakeMR]:
        return [m for m in self.mrs if not m.closed]

    def close(self) -> None:
        pass


class FakeQueuePair:
    _qpns = itertools.count(10)

    def __init__(self, dev: FakeDevice, opts: Any) -> None:
        self.qpn, self.psn, self.event_fd, self.sq_depth = next(self._qpns), 1, None, 16

    def close(self) -> None:
        pass


@pytest.fixture
def transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(verbs, "VerbsDevice", FakeDevice)
    monkeypatch.setattr(verbs, "QueuePair", FakeQueuePair)
    t = verbs.VerbsTransport("fake0", 0, raw_chains=False)
    yield t
    t.close()


def test_shared_mrs_grant_no_remote_access(transport: Any) -> None:
    transport.register([Region(0x10000, 4096), Region(0x20000, 4096)], Access.REMOTE_WRITE)
    transport.register([Region(0x30000, 4096)], Access.LOCAL)
    assert [m.access for m in transport.device.mrs] == [Access.LOCAL] * 3


def test_each_link_gets_its_own_keys_and_loses_them_on_release(transport: Any) -> None:
    dev: FakeDevice = transport.device
    reg = transport.register([Region(0x10000, 4096), Region(0x20000, 8192)], Access.REMOTE_WRITE)
    transport.register([Region(0x30000, 4096)], Access.LOCAL)  # never advertised
    a, b = transport.create_link(), transport.create_link()
    ea, eb = a.endpoint, b.endpoint
    assert [(r.addr, r.length) for r in ea.regions] == [(0x10000, 4096), (0x20000, 8192)]
    assert [(r.addr, r.length) for r in eb.regions] == [(0x10000, 4096), (0x20000, 8192)]
    keys_a, keys_b = {r.rkey for r in ea.regions}, {r.rkey for r in eb.regions}
    assert len(keys_a) == 2 and not keys_a & keys_b
    assert not keys_a & {r.rkey for r in reg.remote}  # not the shared MR's key either
    granted = {m.rkey: m for m in dev.mrs}
    assert all(granted[k].access is Access.REMOTE_WRITE for k in keys_a | keys_b)
    a.release()
    assert all(granted[k].closed for k in keys_a)  # revoked with the link
    assert not any(granted[k].closed for k in keys_b)
    assert transport.link_regions(a.id) == ()
    reg.release()  # deregistering the memory revokes the remaining links' keys too
    assert all(granted[k].closed for k in keys_b)
    assert b.endpoint.regions == ()


def test_prefill_links_advertise_nothing(transport: Any) -> None:
    transport.register([Region(0x10000, 4096)], Access.LOCAL)
    link = transport.create_link()
    assert link.endpoint.regions == ()
    assert len(transport.device.mrs) == 1


def test_close_deregisters_every_key(transport: Any) -> None:
    transport.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)
    transport.create_link()
    transport.create_link()
    assert len(transport.device.live()) == 3
    transport.close()
    assert transport.device.live() == []


@pytest.mark.parametrize(("access", "remote_write"), [(Access.LOCAL, False),
                                                      (Access.REMOTE_WRITE, True)])
def test_mr_flags_never_allow_remote_read(monkeypatch: pytest.MonkeyPatch, access: Access,
                                          remote_write: bool) -> None:
    e = pytest.importorskip("pyverbs.enums")
    seen: list[int] = []

    class MR:
        def __init__(self, pd: object, length: int, flags: int, address: int) -> None:
            seen.append(flags)

    monkeypatch.setitem(sys.modules, "pyverbs.mr", type(sys)("pyverbs.mr"))
    monkeypatch.setattr(sys.modules["pyverbs.mr"], "MR", MR, raising=False)
    dev = object.__new__(verbs_device.VerbsDevice)
    dev.pd, dev.name = object(), "fake0"
    dev.register(0x1000, 4096, access)
    (flags,) = seen
    assert flags & e.IBV_ACCESS_LOCAL_WRITE
    assert not flags & e.IBV_ACCESS_REMOTE_READ and not flags & e.IBV_ACCESS_REMOTE_ATOMIC
    assert bool(flags & e.IBV_ACCESS_REMOTE_WRITE) is remote_write


def test_tcp_link_token_is_per_link_and_revoked() -> None:
    """TCP's counterpart of an rkey: the random token naming a link, forgotten on release."""
    buf = mmap.mmap(-1, 4096)
    t = TcpTransport()
    try:
        t.register([Region(buffer_address(buf), 4096)], Access.REMOTE_WRITE)
        a, b = t.create_link(), t.create_link()
        ta, tb = a.endpoint.extra["token"], b.endpoint.extra["token"]
        assert ta != tb and len(ta) == 32
        a.release()
        assert ta not in t._by_token and tb in t._by_token
    finally:
        t.close()
        buf.close()


def test_shared_keys_mode_when_per_link_keys_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbeam.transport.options import TransportOptions

    monkeypatch.setattr(verbs, "VerbsDevice", FakeDevice)
    monkeypatch.setattr(verbs, "QueuePair", FakeQueuePair)
    t = verbs.VerbsTransport("fake0", 0, TransportOptions(per_link_keys=False), raw_chains=False)
    try:
        reg = t.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)
        a, b = t.create_link(), t.create_link()
        assert a.endpoint.regions == b.endpoint.regions == reg.remote
        device: Any = t.device  # the FakeDevice patched in above
        assert [m.access for m in device.mrs] == [Access.REMOTE_WRITE]  # no per-link MRs
    finally:
        t.close()


class SlowDevice(FakeDevice):
    """A device whose registrations with one access stall until the test lets them go."""

    slow_access = Access.REMOTE_WRITE
    entered = threading.Event()
    gate = threading.Event()

    def register(self, addr: int, length: int, access: Access) -> FakeMR:
        if access is self.slow_access:
            self.entered.set()
            assert self.gate.wait(10), "the test never let the registration finish"
        return super().register(addr, length, access)


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(SlowDevice, "entered", threading.Event())
    monkeypatch.setattr(SlowDevice, "gate", threading.Event())
    monkeypatch.setattr(verbs, "VerbsDevice", SlowDevice)
    monkeypatch.setattr(verbs, "QueuePair", FakeQueuePair)
    t = verbs.VerbsTransport("fake0", 0, raw_chains=False)
    yield t
    SlowDevice.gate.set()
    t.close()


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    assert SlowDevice.entered.wait(5), "the registration never started"
    return thread, out


@pytest.mark.parametrize("what", ["create_link", "register"])
def test_memory_registration_never_holds_the_transport_lock(slow: Any, what: str) -> None:
    """While one link's keys (or a new pool) are being registered, which takes long on
    a large pool, the progress thread can still take the transport lock and every other
    link's events still flow."""
    if what == "create_link":
        slow.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)  # shared MR: LOCAL
        thread, out = _in_background(slow.create_link)
    else:
        SlowDevice.slow_access = Access.LOCAL
        try:
            thread, out = _in_background(
                lambda: slow.register([Region(0x20000, 4096)], Access.LOCAL))
        finally:
            SlowDevice.slow_access = Access.REMOTE_WRITE
    assert slow.lock.acquire(timeout=2), "a registration holds the transport lock"
    slow.lock.release()
    event = Event(EventKind.NOTIFIED, 7, 1)
    done = threading.Thread(target=slow.emit, args=(event,), daemon=True)
    done.start()
    assert slow.events(timeout=2) == [event]
    assert thread.is_alive()  # all of the above happened during the registration
    SlowDevice.gate.set()
    thread.join(5)
    assert len(out) == 1
    if what == "create_link":
        assert [r.addr for r in out[0].endpoint.regions] == [0x10000]


def test_a_registration_released_while_a_link_registers_over_it_is_not_granted(
        slow: Any) -> None:
    reg = slow.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)
    thread, out = _in_background(slow.create_link)
    reg.release()  # meanwhile: create_link must not record (or leak) keys over it
    SlowDevice.gate.set()
    thread.join(5)
    (link,) = out
    assert link.endpoint.regions == ()
    assert slow.device.live() == []


class BrokenQueuePair(FakeQueuePair):
    """Connects, then reports one flushed receive: the link fails on the progress thread."""

    made: ClassVar[list[BrokenQueuePair]] = []

    def __init__(self, dev: FakeDevice, opts: Any) -> None:
        super().__init__(dev, opts)
        self.broken = threading.Event()
        self.made.append(self)

    def to_rts(self, *args: Any) -> None:
        pass

    def arm(self) -> None:
        pass

    def poll(self, n: int) -> list[Any]:
        if not self.broken.is_set():
            return []
        self.broken.clear()
        return [SimpleNamespace(wr_id=RECV_TAG, status=5, vendor_err=0)]  # IBV_WC_WR_FLUSH_ERR


def test_keys_of_a_link_that_fails_on_the_progress_thread_go_outside_the_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs, "VerbsDevice", FakeDevice)
    monkeypatch.setattr(verbs, "QueuePair", BrokenQueuePair)
    t: Any = verbs.VerbsTransport("fake0", 0, raw_chains=False)
    lock_free: list[bool] = []

    def probe() -> None:
        got = t.lock.acquire(timeout=2)
        lock_free.append(got)
        if got:
            t.lock.release()

    class WatchedMR(FakeMR):
        def close(self) -> None:  # could another thread take the transport lock now?
            thread = threading.Thread(target=probe)
            thread.start()
            thread.join()
            super().close()

    try:
        t.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)
        monkeypatch.setattr(t.device, "register", lambda a, n, acc: t.device.mrs.append(
            WatchedMR(a, n, acc)) or t.device.mrs[-1])
        link = t.create_link()
        (key,) = [r.rkey for r in link.endpoint.regions]
        link.connect(Endpoint("rdma", (RemoteRegion(0x4000_0000, 4096, 9),), gid="fe80::2",
                              qpns=(5,), psn=3, mtu=4096))
        BrokenQueuePair.made[-1].broken.set()
        event = t.events(timeout=5)
        assert [e.status for e in event] == ["IBV_WC_WR_FLUSH_ERR"]  # LINK_FAILED
        mr = next(m for m in t.device.mrs if m.rkey == key)
        assert wait_until(lambda: mr.closed, 5)
        assert lock_free == [True]  # deregistered after the progress thread let go
        assert t.link_regions(link.id) == ()
    finally:
        t.close()
