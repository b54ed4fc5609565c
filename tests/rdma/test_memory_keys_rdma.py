"""Least access on a real (or soft-RoCE) device: per-link rkeys, revocation, no remote read.

Two transports in this process play prefill (source registered LOCAL) and decode
(destination registered REMOTE_WRITE, once); their links are RC QPs on the same device
and each decode link's keys are its own memory windows (type 2 with one QP per link,
bound to it; type 1 with several). A "peer that went away" is a released decode link;
its old rkeys are then tried from a fresh QP, as a stale or malicious peer would.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvbeam.transport import Access, Blocks, Event, EventKind, Region, RemoteRegion
from kvbeam.transport.options import TransportOptions
from tests.rdma.conftest import RdmaDevice
from tests.transport_peer import buffer_address

pytestmark = pytest.mark.rdma

verbs = pytest.importorskip("kvbeam.transport.verbs")  # a skip here fails (conftest)

SIZE = 1 << 20
FILL = 0xEE
OPTIONS = TransportOptions(op_timeout_s=10.0)
ACCESS_ERRORS = ("IBV_WC_REM_ACCESS_ERR",)


class Pair:
    """A prefill transport and a decode transport on one device, with their buffers."""

    def __init__(self, device: RdmaDevice, options: TransportOptions = OPTIONS) -> None:
        self.src = mmap.mmap(-1, SIZE)
        self.src.write(np.random.default_rng(7).integers(0, 256, SIZE, np.uint8).tobytes())
        self.dst = mmap.mmap(-1, SIZE)
        self.dst.write(bytes([FILL]) * SIZE)
        self.src_addr, self.dst_addr = buffer_address(self.src), buffer_address(self.dst)
        self.prefill = verbs.VerbsTransport(device.name, device.gid_index, options)
        self.decode = verbs.VerbsTransport(device.name, device.gid_index, options)
        self.src_reg = self.prefill.register([Region(self.src_addr, SIZE)], Access.LOCAL)
        self.dst_reg = self.decode.register([Region(self.dst_addr, SIZE)], Access.REMOTE_WRITE)

    def connect(self, forge: Callable[[Any], Any] | None = None) -> tuple[Any, Any]:
        """A handshake: a prefill link and a decode link; ``forge`` edits decode's endpoint."""
        lp, ld = self.prefill.create_link(), self.decode.create_link()
        ld.connect(lp.endpoint)
        endpoint = ld.endpoint
        lp.connect(forge(endpoint) if forge else endpoint)
        return lp, ld

    def write(self, link: Any, transfer_id: int, dst_offset: int = 0,
              length: int = 65536) -> Event:
        """Write ``length`` bytes from the source start; the writer's outcome."""
        link.write(transfer_id, Blocks(np.array([self.src_addr], np.uint64),
                                       np.array([self.dst_addr + dst_offset], np.uint64),
                                       np.array([length], np.uint64)))
        return wait_for(self.prefill, lambda e: e.transfer_id == transfer_id)

    def landed(self, dst_offset: int = 0, length: int = 65536) -> bool:
        return self.dst[dst_offset:dst_offset + length] == self.src[:length]

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.src.close()
        self.dst.close()


def wait_for(transport: Any, match: Callable[[Event], bool], timeout: float = 60.0) -> Event:
    """The first event of ``transport`` matching ``match`` (others are dropped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in transport.events(max(0.0, deadline - time.monotonic())):
            if match(event):
                found: Event = event
                return found
    raise AssertionError(f"no matching event within {timeout} s")


@pytest.fixture
def pair(rdma_device: RdmaDevice) -> Iterator[Pair]:
    p = Pair(rdma_device)
    yield p
    p.close()


@pytest.fixture
def multi_qp_pair(rdma_device: RdmaDevice) -> Iterator[Pair]:
    """Two QPs per link: one key per region for both, so type-1 windows."""
    p = Pair(rdma_device, dataclasses.replace(OPTIONS, qps_per_peer=2))
    yield p
    p.close()


def test_each_peer_gets_its_own_rkeys(pair: Pair) -> None:
    lp1, ld1 = pair.connect()
    lp2, ld2 = pair.connect()
    keys1 = [r.rkey for r in ld1.endpoint.regions]
    keys2 = [r.rkey for r in ld2.endpoint.regions]
    assert len(keys1) == len(keys2) == 1
    assert keys1 != keys2
    assert keys1[0] != pair.dst_reg.remote[0].rkey != keys2[0]
    assert pair.write(lp1, 1, 0).ok and pair.landed(0)
    assert pair.write(lp2, 2, 65536).ok and pair.landed(65536)


@pytest.mark.parametrize("pairing", ["pair", "multi_qp_pair"])
def test_old_peer_rkey_stops_working_after_it_goes_away(
        request: pytest.FixtureRequest, pairing: str) -> None:
    pair: Pair = request.getfixturevalue(pairing)
    lp1, ld1 = pair.connect()
    assert pair.write(lp1, 1).ok and pair.landed()
    stale = ld1.endpoint.regions
    ld1.release()  # decode drops the peer: its keys are deregistered with the link
    lp1.release()
    before = bytes(pair.dst)
    lp2, _ = pair.connect(lambda ep: dataclasses.replace(ep, regions=stale))
    event = pair.write(lp2, 2, 131072)
    assert (event.ok, event.status) == (False, "IBV_WC_REM_ACCESS_ERR"), event
    assert bytes(pair.dst) == before  # nothing landed
    lp3, ld3 = pair.connect()  # a new handshake gets fresh keys that work
    assert {r.rkey for r in ld3.endpoint.regions}.isdisjoint(r.rkey for r in stale)
    assert pair.write(lp3, 3, 131072).ok and pair.landed(131072)


def test_a_live_peers_rkey_does_not_work_on_another_peers_qp(pair: Pair) -> None:
    """Type-2 windows are bound to their link's QP: a peer that learned another live
    peer's keys still cannot write with them (per-link MRs allowed that)."""
    lp1, ld1 = pair.connect()
    lp2, ld2 = pair.connect(lambda ep: dataclasses.replace(ep, regions=ld1.endpoint.regions))
    assert ld2.endpoint.regions != ld1.endpoint.regions
    before = bytes(pair.dst)
    event = pair.write(lp2, 2, 65536)
    assert (event.ok, event.status) == (False, "IBV_WC_REM_ACCESS_ERR"), event
    assert bytes(pair.dst) == before
    assert pair.write(lp1, 1).ok and pair.landed()  # its own peer's writes still work


@pytest.mark.parametrize("whose", ["decode", "prefill"])
def test_shared_registration_keys_grant_no_remote_write(pair: Pair, whose: str) -> None:
    """Neither the decode pool's shared MR nor prefill's LOCAL one accepts a remote write."""
    if whose == "decode":
        lp, _ = pair.connect(lambda ep: dataclasses.replace(ep, regions=(
            RemoteRegion(pair.dst_addr, SIZE, pair.dst_reg.remote[0].rkey),)))
        before = bytes(pair.dst)
        event = pair.write(lp, 4)
        assert bytes(pair.dst) == before
    else:  # decode's link writes into prefill's source with prefill's only key
        lp, ld = pair.prefill.create_link(), pair.decode.create_link()
        lp.connect(ld.endpoint)
        ld.connect(dataclasses.replace(lp.endpoint, regions=(
            RemoteRegion(pair.src_addr, SIZE, pair.src_reg.remote[0].rkey),)))
        before = bytes(pair.src)
        ld.write(5, Blocks(np.array([pair.dst_addr], np.uint64),
                           np.array([pair.src_addr], np.uint64), np.array([4096], np.uint64)))
        event = wait_for(pair.decode, lambda e: e.transfer_id == 5)
        assert bytes(pair.src) == before
    assert (event.ok, event.status) == (False, "IBV_WC_REM_ACCESS_ERR"), event


def test_no_remote_read_even_with_a_valid_rkey(pair: Pair) -> None:
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    lp, ld = pair.connect()
    region = ld.endpoint.regions[0]
    pair.dst[:4096] = b"\x5a" * 4096
    before = bytes(pair.src[:4096])
    lkey = pair.prefill._mrs[id(pair.src_reg)][0].lkey
    wr = SendWR(wr_id=0x77, opcode=e.IBV_WR_RDMA_READ, num_sge=1,
                sg=[SGE(pair.src_addr, 4096, lkey)], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(region.rkey, region.addr)
    lp._qps[0].qp.post_send(wr)
    event = wait_for(pair.prefill, lambda ev: ev.kind is EventKind.LINK_FAILED)
    # The responder refuses at the QP (no remote-read access: invalid request) or the MR.
    assert event.status in ("IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR"), event
    assert bytes(pair.src[:4096]) == before  # nothing was read into our buffer


#: The child of the test below: a decode transport with one connected link (its memory
#: window bound to the link's QP), then it says so and waits to be killed.
_KILLED_CHILD = """
import mmap, sys, time
from kvbeam.transport import Access, Region
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs import VerbsTransport
from tests.transport_peer import buffer_address
name, gid = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, 1 << 20)
prefill = VerbsTransport(name, gid, TransportOptions(op_timeout_s=10.0))
decode = VerbsTransport(name, gid, TransportOptions(op_timeout_s=10.0))
decode.register([Region(buffer_address(buf), 1 << 20)], Access.REMOTE_WRITE)
lp, ld = prefill.create_link(), decode.create_link()
ld.connect(lp.endpoint)
lp.connect(ld.endpoint)
print("bound", flush=True)
time.sleep(600)
"""
#: What the kernel logs when rxe's destroy of an object still referenced gave up waiting
#: for it (a QP held by a type-2 memory window bound to it): the WARN_ON in
#: ``__rxe_cleanup`` (drivers/infiniband/sw/rxe/rxe_pool.c, Debian's 6.1: 50 s per object),
#: or, in kernels that only print, "Timed out waiting for qp#N to complete".
RXE_GAVE_UP = re.compile(r"rxe_pool\.c|__rxe_cleanup|Timed out waiting for \S+ to complete")


class KernelLog:
    """The kernel's log from now on (``/dev/kmsg``; root, as the RDMA suite runs), opened
    with a line of our own, so reading it back proves the log was read at all."""

    def __init__(self, note: str) -> None:
        self.note = f"kvbeam-test: {note}"
        self.fd = os.open("/dev/kmsg", os.O_RDWR | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)  # only what comes after this
        os.write(self.fd, f"{self.note}\n".encode())

    def read(self) -> list[str]:
        """Every message logged since (each record's text, continuation lines included)."""
        out: list[str] = []
        while True:
            try:
                record = os.read(self.fd, 8192)
            except BlockingIOError:  # none left
                return out
            except BrokenPipeError:  # records overwritten before we read them: go on
                continue
            out.append(record.decode("utf-8", "replace").partition(";")[2])

    def close(self) -> None:
        os.close(self.fd)


def test_sigkilled_process_with_bound_windows_exits_at_once(rdma_device: RdmaDevice) -> None:
    """A daemon killed with links whose windows are bound must exit at once.

    At process exit the kernel destroys a process's verbs objects newest first; a QP
    created after its link's windows went before them, and rxe then waited for the
    type-2 window bound to it to let go until its own timeout (the process took 53 s to
    exit), and said so in the kernel log. Links create their QPs first now. What the
    kernel logs tells the two apart (how long the exit took is only printed).
    """
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, rdma_device.name,
                              str(rdma_device.gid_index)], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd())
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "bound"
        kernel = KernelLog(f"SIGKILL to pid {child.pid}, which has a bound memory window")
        try:
            t0 = time.monotonic()
            child.send_signal(signal.SIGKILL)
            child.wait(120)  # a wait: longer than rxe's, which gives up and says so
            print(f"SIGKILLed process with a bound memory window exited after "
                  f"{time.monotonic() - t0:.2f} s")
            said = kernel.read()
        finally:
            kernel.close()
        # Its verbs objects went in an order rxe destroys without waiting: the kernel says
        # nothing of a destroy that waited for an object still held, and gave up.
        assert [m for m in said if m.startswith(kernel.note)], said
        assert not [m for m in said if RXE_GAVE_UP.search(m)], said
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(60)
