"""Least access for registered memory, on the host: MR flags and per-link keys (fake device).

The real device runs the same paths in tests/rdma/test_memory_keys_rdma.py; here a
fake device records what would be registered and which memory windows exist, so the
bookkeeping (which MR grants what, which keys a link advertises, when they are
revoked, that a handshake registers nothing) is checked fast.
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

from kvbeam.transport import Access, Endpoint, Event, EventKind, Region, RemoteRegion
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.tcp import TcpTransport
from kvbeam.transport.verbs import device as verbs_device
from kvbeam.transport.verbs import transport as verbs
from kvbeam.transport.verbs.qp import RECV_TAG
from tests.transport_peer import buffer_address

# pyverbs is part of `make setup`: a missing one fails here rather than skipping.
from tests.waiting import wait_until

_keys = itertools.count(0x100)


class FakeMR:
    """What ibv_reg_mr would return: keys and the access it grants."""

    def __init__(self, addr: int, length: int, access: Access, windows: bool = False) -> None:
        self.addr, self.length, self.access, self.windows = addr, length, access, windows
        self.lkey = self.rkey = next(_keys)
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeWindow:
    """A memory window: remote write through its own key over part of an MR."""

    made: ClassVar[list[FakeWindow]] = []

    def __init__(self, dev: Any, mr: FakeMR, addr: int, length: int, mw_type: int) -> None:
        assert mr.windows, "a window over an MR that does not allow them"
        self.mr, self.addr, self.length, self.mw_type = mr, addr, length, mw_type
        self.access = Access.REMOTE_WRITE
        self.rkey = next(_keys)
        self.closed = self.bound = False
        dev.windows.append(self)

    def close(self) -> None:
        self.closed = True


def fake_bind(qp: Any, windows: list[FakeWindow], timeout: float) -> None:
    for window in windows:
        window.bound = True


class FakeDevice:
    """Records every MR and window; enough of VerbsDevice for the transport and links."""

    window_kind: ClassVar[int | None] = 2  # what window_type answers (None: no windows)

    def __init__(self, name: str, gid_index: int) -> None:
        self.name, self.gid_index = name, gid_index
        self.gid, self.mtu = "fe80:0000:0000:0000:0000:0000:0000:0001", 3
        self.mrs: list[FakeMR] = []
        self.windows: list[FakeWindow] = []

    def window_type(self, qps_per_link: int) -> int | None:
        return self.window_kind

    def register(self, addr: int, length: int, access: Access, *,
                 windows: bool = False) -> FakeMR:
        mr = FakeMR(addr, length, access, windows)
        self.mrs.append(mr)
        return mr

    def all_keys(self) -> list[FakeMR | FakeWindow]:
        """Every MR and window, in creation order of each kind."""
        return [*self.mrs, *self.windows]

    def live(self) -> list[FakeMR | FakeWindow]:
        return [m for m in self.all_keys() if not m.closed]

    def close(self) -> None:
        pass


class FakeQueuePair:
    _qpns = itertools.count(10)

    def __init__(self, dev: FakeDevice, opts: Any) -> None:
        self.qpn, self.psn, self.event_fd, self.sq_depth = next(self._qpns), 1, None, 16

    def to_rts(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


PEER = Endpoint("rdma", (RemoteRegion(0x4000_0000, 4096, 9),), gid="fe80::2", qpns=(5,), psn=3,
                mtu=4096)


def fake_verbs(monkeypatch: pytest.MonkeyPatch, device: type[FakeDevice] = FakeDevice,
               qp: type[FakeQueuePair] = FakeQueuePair,
               window: type[FakeWindow] = FakeWindow) -> None:
    """The transport's device, QPs and memory windows replaced by fakes."""
    monkeypatch.setattr(verbs, "VerbsDevice", device)
    monkeypatch.setattr(verbs, "QueuePair", qp)
    monkeypatch.setattr(verbs, "Window", window, raising=False)
    monkeypatch.setattr(verbs, "bind_windows", fake_bind, raising=False)


@pytest.fixture
def transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    fake_verbs(monkeypatch)
    t = verbs.VerbsTransport("fake0", 0, TransportOptions(poster="pyverbs"))
    yield t
    t.close()


def test_shared_mrs_grant_no_remote_access(transport: Any) -> None:
    transport.register([Region(0x10000, 4096), Region(0x20000, 4096)], Access.REMOTE_WRITE)
    transport.register([Region(0x30000, 4096)], Access.LOCAL)
    assert [m.access for m in transport.device.mrs] == [Access.LOCAL] * 3
    assert [m.windows for m in transport.device.mrs] == [True, True, False]


def test_a_handshake_registers_no_memory(transport: Any) -> None:
    """A link (one per handshake) gets windows over the pools' one registration: its
    cost does not grow with the pool; the windows are bound when it connects."""
    dev: FakeDevice = transport.device
    transport.register([Region(0x10000, 1 << 30), Region(0x50000000, 1 << 30)],
                       Access.REMOTE_WRITE)
    registered = len(dev.mrs)
    links = [transport.create_link() for _ in range(3)]
    for link in links:
        link.connect(PEER)
    assert len(dev.mrs) == registered, "a link registered memory"
    assert len(dev.windows) == 6 and all(w.bound for w in dev.windows)
    assert all(w.mw_type == 2 for w in dev.windows)  # one QP per link: bound to it

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
    granted = {m.rkey: m for m in dev.all_keys()}
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


def test_close_revokes_and_deregisters_every_key(transport: Any) -> None:
    transport.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)
    transport.create_link()
    transport.create_link()
    assert len(transport.device.live()) == 3
    transport.close()
    assert transport.device.live() == []


@pytest.mark.parametrize(("access", "windows", "remote_write"), [
    (Access.LOCAL, False, False), (Access.REMOTE_WRITE, False, True), (Access.LOCAL, True, False)])
def test_mr_flags_never_allow_remote_read(monkeypatch: pytest.MonkeyPatch, access: Access,
                                          windows: bool, remote_write: bool) -> None:
    e = pytest.importorskip("pyverbs.enums")
    seen: list[int] = []

    class MR:
        def __init__(self, pd: object, length: int, flags: int, address: int) -> None:
            seen.append(flags)

    monkeypatch.setitem(sys.modules, "pyverbs.mr", type(sys)("pyverbs.mr"))
    monkeypatch.setattr(sys.modules["pyverbs.mr"], "MR", MR, raising=False)
    dev = object.__new__(verbs_device.VerbsDevice)
    dev.pd, dev.name = object(), "fake0"
    dev.register(0x1000, 4096, access, windows=windows)
    (flags,) = seen
    assert bool(flags & e.IBV_ACCESS_MW_BIND) is windows
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


@pytest.mark.parametrize("why", ["per_link_keys off", "device without windows"])
def test_shared_keys_mode(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                          why: str) -> None:
    fake_verbs(monkeypatch)
    if why == "device without windows":
        monkeypatch.setattr(FakeDevice, "window_kind", None)
    options = TransportOptions(per_link_keys=why != "per_link_keys off", poster="pyverbs")
    t = verbs.VerbsTransport("fake0", 0, options)
    try:
        reg = t.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)
        a, b = t.create_link(), t.create_link()
        assert a.endpoint.regions == b.endpoint.regions == reg.remote
        device: Any = t.device  # the FakeDevice patched in above
        assert [m.access for m in device.mrs] == [Access.REMOTE_WRITE]  # no per-link keys
        assert device.windows == []
        warned = "has no memory windows: every peer gets the same" in caplog.text
        assert warned is (why == "device without windows")
    finally:
        t.close()


def test_several_qps_per_link_get_type_1_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A type-2 window works on one QP only; a link's endpoint has one key per region for
    all its QPs, so with several the windows are type 1 (the device says which it has)."""
    from kvbeam.transport.verbs.device import VerbsDevice

    e = pytest.importorskip("pyverbs.enums")
    dev = object.__new__(VerbsDevice)
    dev.max_mw = 1 << 16
    dev.cap_flags = e.IBV_DEVICE_MEM_WINDOW | e.IBV_DEVICE_MEM_WINDOW_TYPE_2B
    assert (dev.window_type(1), dev.window_type(4)) == (2, 1)
    dev.cap_flags = e.IBV_DEVICE_MEM_WINDOW
    assert dev.window_type(1) == 1
    dev.max_mw = 0
    assert dev.window_type(1) is None


class SlowDevice(FakeDevice):
    """A device whose registrations (or window allocations) stall until the test lets
    them go: ``slow`` says which."""

    slow = "window"
    entered = threading.Event()
    gate = threading.Event()

    @classmethod
    def stall(cls, what: str) -> None:
        if what == cls.slow:
            cls.entered.set()
            assert cls.gate.wait(10), f"the test never let the {what} finish"

    def register(self, addr: int, length: int, access: Access, *,
                 windows: bool = False) -> FakeMR:
        self.stall("registration")
        return super().register(addr, length, access, windows=windows)


class SlowWindow(FakeWindow):
    def __init__(self, dev: Any, mr: FakeMR, addr: int, length: int, mw_type: int) -> None:
        SlowDevice.stall("window")
        super().__init__(dev, mr, addr, length, mw_type)


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(SlowDevice, "entered", threading.Event())
    monkeypatch.setattr(SlowDevice, "gate", threading.Event())
    monkeypatch.setattr(SlowDevice, "slow", "window")
    fake_verbs(monkeypatch, SlowDevice, window=SlowWindow)
    t = verbs.VerbsTransport("fake0", 0, TransportOptions(poster="pyverbs"))
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
    """While a new pool is being registered, which takes long on a large pool (or a
    link's windows allocated), the progress thread can still take the transport lock
    and every other link's events still flow."""
    if what == "create_link":
        slow.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)  # shared MR: LOCAL
        thread, out = _in_background(slow.create_link)
    else:
        SlowDevice.slow = "registration"
        thread, out = _in_background(
            lambda: slow.register([Region(0x20000, 4096)], Access.LOCAL))
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


@pytest.mark.parametrize("how", ["release", "failure on the progress thread"])
def test_a_links_windows_go_before_its_qps(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A bound type-2 window holds its QP (rxe waits for it before destroying the QP):
    released or failed, a link deallocates its windows first."""
    order: list[str] = []

    class RecordingWindow(FakeWindow):
        def close(self) -> None:
            order.append("window")
            super().close()

    class RecordingQueuePair(BrokenQueuePair):
        def close(self) -> None:
            order.append("qp")

    fake_verbs(monkeypatch, qp=RecordingQueuePair, window=RecordingWindow)
    t: Any = verbs.VerbsTransport("fake0", 0, TransportOptions(poster="pyverbs"))
    try:
        t.register([Region(0x10000, 4096)], Access.REMOTE_WRITE)
        link = t.create_link()
        link.connect(PEER)
        if how == "release":
            link.release()
        else:
            BrokenQueuePair.made[-1].broken.set()
            event = t.events(timeout=5)
            assert [e.status for e in event] == ["IBV_WC_WR_FLUSH_ERR"]  # LINK_FAILED
            assert wait_until(lambda: "qp" in order, 5)
        assert order == ["window", "qp"]
        assert t.link_regions(link.id) == ()
    finally:
        t.close()
