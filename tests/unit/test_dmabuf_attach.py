"""``memory_kind: dmabuf`` on the daemon: its refusals, the reserved iovas, the verbs bookkeeping.

No dma-buf exporter exists on the test host (no udmabuf, no DRM), so what needs a real
dma-buf fd runs in the soft-RoCE guest (tests/rdma/test_dmabuf_rdma.py, vgem). Here: the
refusals a daemon gives before and without one (integrity on, a memfd posing as a
dma-buf, an fd that cannot be mapped over TCP, a device that refuses the registration),
and, with a test subclass that takes memfds for dma-bufs, the RDMA path's reserved
address ranges and what it registers; the verbs transport's records of dma-buf MRs
(their own keys, no windows) with a fake MR.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from kvbeam.engine import EnginePools
from kvbeam.errors import AttachError, TransportError
from kvbeam.pools.shm import unmap
from kvbeam.proto.attach_codec import AttachRequest
from kvbeam.server.engines.dmabuf import INTEGRITY_REFUSED, DmabufAccess, rdma_driver
from kvbeam.server.engines.memory import map_engine_memory
from kvbeam.transport.base import Access, Registration
from kvbeam.transport.core import RegistrationBook
from kvbeam.transport.endpoint import DmaBufRegion, Region, RemoteRegion
from tests.fixtures import side


class FakeTransport:
    """Just what DmabufAccess reads: the kind, the device's name, the registrations."""

    def __init__(self, kind: str, fail: str = "") -> None:
        self.kind = kind
        self.device = SimpleNamespace(name="fake0")
        self.fail = fail
        self.dmabuf_regions: list[DmaBufRegion] = []
        self.regions: list[Region] = []

    def register(self, regions: list[Region], access: Access) -> Registration:
        self.regions += regions
        return Registration(regions, access, [], lambda r: None)

    def register_dmabuf(self, regions: list[DmaBufRegion], access: Access) -> Registration:
        if self.fail:
            raise TransportError(self.fail)
        self.dmabuf_regions += regions
        return Registration([r.region for r in regions], access, [], lambda r: None)


class MemfdsAsDmabufs(DmabufAccess):
    """Takes memfds for dma-bufs (the host has no exporter): the size check only."""

    @staticmethod
    def size(fd: int, field: str, used_by: str) -> int:
        return os.fstat(fd).st_size


def _dmabuf_request(pools: EnginePools) -> AttachRequest:
    b = pools.buffers()
    return AttachRequest("attach", "dmabuf", pools.config, tuple(tuple(c) for c in b.components))


def _access(cls: type[DmabufAccess], kind: str, integrity: bool, fail: str = ""
            ) -> tuple[DmabufAccess, FakeTransport]:
    t = FakeTransport(kind, fail)
    return cls(t, integrity), t  # type: ignore[arg-type]


def test_integrity_on_refuses_a_dmabuf_attach_before_any_fd_is_looked_at() -> None:
    access, _ = _access(DmabufAccess, "rdma", True)
    with EnginePools(side()) as pools, pytest.raises(AttachError) as info:
        map_engine_memory(_dmabuf_request(pools), [os.dup(fd) for fd in pools.fds], "decode",
                          None, dmabuf=access)
    assert str(info.value) == INTEGRITY_REFUSED and info.value.field == "memory_kind"
    assert "--integrity false" in str(info.value) and "kvbeam.engine.staging" in str(info.value)


def test_a_memfd_is_not_a_dmabuf() -> None:
    access, _ = _access(DmabufAccess, "tcp", False)
    with EnginePools(side()) as pools, pytest.raises(AttachError) as info:
        map_engine_memory(_dmabuf_request(pools), [os.dup(fd) for fd in pools.fds], "decode",
                          None, dmabuf=access)
    assert info.value.field == "fds[0]"
    assert "not a dma-buf (statfs type 0x1021994)" in str(info.value)
    assert "a memfd is memory_kind host_shm" in str(info.value)


def test_tcp_refuses_a_dmabuf_it_cannot_map_in_one_line() -> None:
    access, _ = _access(DmabufAccess, "tcp", False)
    r, w = os.pipe()
    try:
        with pytest.raises(AttachError) as info:
            access.map(r, 4096, "fds[0]")
    finally:
        os.close(r)
        os.close(w)
    text = str(info.value)
    assert "\n" not in text and info.value.field == "fds[0]"
    assert text.startswith("memory_kind dmabuf: the tcp transport moves bytes with the CPU "
                           "and cannot map fds[0] (mmap: ")
    assert "use RDMA with a NIC that registers dma-buf" in text and "staging" in text


def test_rdma_reserves_an_address_range_per_fd_and_registers_the_fds_there() -> None:
    access, transport = _access(MemfdsAsDmabufs, "rdma", False)
    with EnginePools(side()) as pools:
        pools.fill_pattern(1)
        memory = map_engine_memory(_dmabuf_request(pools), [os.dup(fd) for fd in pools.fds],
                                   "decode", None, dmabuf=access)
        held = memory.dmabuf
        assert held is not None and len(held.fds) == len(pools.fds)
        regions = memory.side.tensor_regions()
        assert list(held.regions) == regions
        # Reservations, not the engine's pages: the memfd's bytes are not there.
        maps = []
        for m in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in m.split()[0].split("-"))
            maps.append((lo, hi, m.split()[1]))
        for r in regions:  # (adjacent reservations may show as one merged mapping)
            perms = next(p for lo, hi, p in maps if lo <= r.addr and r.end <= hi)
            assert perms == "---p", (r, perms)  # PROT_NONE, private
        access.register(held, Access.REMOTE_WRITE)
        held.close()
        assert [(d.iova, d.length, d.offset) for d in transport.dmabuf_regions] == \
            [(r.addr, r.length, 0) for r in regions]
        unmap(memory.side.take_maps())


def test_a_device_that_refuses_the_registration_is_answered_in_one_line() -> None:
    access, _ = _access(MemfdsAsDmabufs, "rdma", False,
                        fail="ibv_reg_dmabuf_mr of 4096 bytes at offset 0 of dma-buf fd 9 on "
                             "fake0 failed: Operation not supported (errno 95)")
    with EnginePools(side()) as pools:
        memory = map_engine_memory(_dmabuf_request(pools), [os.dup(fd) for fd in pools.fds],
                                   "decode", None, dmabuf=access)
        assert memory.dmabuf is not None
        with pytest.raises(AttachError) as info:
            access.register(memory.dmabuf, Access.REMOTE_WRITE)
        memory.dmabuf.close()
        unmap(memory.side.take_maps())
    text = str(info.value)
    assert "\n" not in text and info.value.field == "memory_kind"
    assert text.startswith("memory_kind dmabuf: RDMA device fake0 (driver unknown driver) "
                           "cannot register dma-buf memory (ibv_reg_dmabuf_mr of 4096 bytes")
    assert "Operation not supported (errno 95)" in text
    assert text.endswith("attach host memory and stage the KV through it instead "
                         "(kvbeam.engine.staging, docs/gpu.md)")


def test_software_devices_name_their_driver() -> None:
    assert rdma_driver("rxe0") == "rdma_rxe" and rdma_driver("siw_eth0") == "siw"


# ---- the verbs transport's records of dma-buf MRs --------------------------------------
class FakeMR:
    closed: ClassVar[list[int]] = []

    def __init__(self, pd: Any, fd: int, offset: int, length: int, iova: int,
                 remote_write: bool, device: str) -> None:
        self.lkey, self.rkey, self.fd = 100 + fd, 200 + fd, fd

    def close(self) -> None:
        FakeMR.closed.append(self.fd)


def _verbs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A VerbsTransport's bookkeeping without a device (memory windows 'supported')."""
    from kvbeam.transport.verbs import transport as vt

    monkeypatch.setattr(vt, "DmaBufMR", FakeMR)
    t = object.__new__(vt.VerbsTransport)
    t._book = RegistrationBook()
    t._lock = threading.RLock()
    t._mrs, t._own_keys, t._grants = {}, set(), {}
    t._window_type, t._closed = 2, False
    t.device = SimpleNamespace(pd=object(), name="fake0")  # type: ignore[assignment]
    return t


def test_dmabuf_mrs_grant_their_own_keys_and_get_no_windows(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    t = _verbs(monkeypatch)
    reg = t.register_dmabuf([DmaBufRegion(7, 0, 4096, 1 << 40),
                             DmaBufRegion(8, 0, 8192, 2 << 40)], Access.REMOTE_WRITE)
    assert t._grant() == []  # no memory window over a dma-buf MR
    t._grants[5] = []
    assert t.link_regions(5) == (RemoteRegion(1 << 40, 4096, 207),
                                 RemoteRegion(2 << 40, 8192, 208))
    FakeMR.closed.clear()
    reg.release()
    assert sorted(FakeMR.closed) == [7, 8] and t.link_regions(5) == ()
    assert not t._own_keys and not t._mrs


def test_a_refused_dmabuf_registration_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _verbs(monkeypatch)

    class Refusing(FakeMR):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if args[1] == 8:
                raise TransportError("refused")
            super().__init__(*args, **kwargs)

    from kvbeam.transport.verbs import transport as vt

    monkeypatch.setattr(vt, "DmaBufMR", Refusing)
    FakeMR.closed.clear()
    with pytest.raises(TransportError, match="refused"):
        t.register_dmabuf([DmaBufRegion(7, 0, 4096, 1 << 40),
                           DmaBufRegion(8, 0, 4096, 2 << 40)], Access.REMOTE_WRITE)
    assert FakeMR.closed == [7] and t._book.all() == [] and not t._mrs


def test_dataclass_region_of_a_dmabuf_is_its_iova() -> None:
    d = DmaBufRegion(3, 4096, 100, 1 << 41)
    assert d.region == Region(1 << 41, 100)
    assert dataclasses.replace(d, iova=5).region.addr == 5


def test_mmap_prot_none_is_what_rdma_reserves() -> None:
    access, _ = _access(DmabufAccess, "rdma", False)
    m = access.map(-1, 1 << 20, "fds[0]")
    try:
        assert len(m) == 1 << 20 and isinstance(m, mmap.mmap)
    finally:
        m.close()
