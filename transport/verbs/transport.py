"""RDMA transport over pyverbs: RC QPs, RDMA WRITE chains, WRITE WITH IMM notifications.

pyverbs is imported when a :class:`VerbsTransport` is constructed, not before:
``import kvbeam.transport`` works where rdma-core is absent.

**One loop thread** owns every post and poll: the daemon's (``kvbeam-loop``:
``open_transport(loop=...)``), or, for a transport built alone (a test, a bench), a
:class:`~kvbeam.loop.DaemonLoop` of its own (``kvbeam-verbs-<device>``). The transport is
a source of that loop. The links' completion-channel fds sit in an epoll set of the
transport's own, whose fd the loop watches (a closed channel's fd leaves that set with
it, never a stale entry in the loop's selector that a new socket of the same number
would collide with). The loop services the links when a writer woke it, a completion
event came, a link's deadline or the back-off poll is due, or the last service did
something; otherwise the CQs are armed and the loop sleeps, so an idle transport costs
no CPU. Events the loop sees are delivered on it, once the transport lock is released:
no hand-off to another thread.

Memory keys are per link (least access), and memory is registered once:
:meth:`VerbsTransport.register` gives every region one MR with local access only
(REMOTE_WRITE regions may have memory windows bound over them), and each link gets
its own memory window per REMOTE_WRITE region that exists when it is created
(:mod:`kvbeam.transport.verbs.windows`: constant work per region, whatever its size),
bound when the link connects. Its endpoint carries only those rkeys; releasing the
link (or its failure) deallocates the windows, so a peer that went away holds no key
that still works, and one peer's rkeys are not another's. On a device without memory
windows (or with ``per_link_keys`` off) the MRs of REMOTE_WRITE regions grant remote
write themselves and every link advertises their keys. No MR or window ever allows
remote read.

Links reach the transport only through :class:`~kvbeam.transport.verbs.linkhost.VerbsHost`
(see :mod:`kvbeam.transport.host`).

The lock order of kvbeam.transport is in docs/concurrency.md ("kvbeam.transport's locks").
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import selectors
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvbeam.errors import RegionError, TransportError
from kvbeam.loop import DaemonLoop, leave_loop
from kvbeam.transport.base import Access, Event, Registration, Transport
from kvbeam.transport.endpoint import DmaBufRegion, Endpoint, Region, RemoteRegion
from kvbeam.transport.host import LinkHostBase
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.stats import TransportStats
from kvbeam.transport.verbs.chain import Poster
from kvbeam.transport.verbs.device import VerbsDevice, mtu_bytes
from kvbeam.transport.verbs.dmabuf_mr import DmaBufMR
from kvbeam.transport.verbs.link import VerbsLink
from kvbeam.transport.verbs.pyverbs_import import import_pyverbs
from kvbeam.transport.verbs.qp import QueuePair
from kvbeam.transport.verbs.windows import Window, bind_windows

log = logging.getLogger(__name__)

_BACKOFF_S = (1e-4, 5e-3)  # first and longest sleep when a link has no event fd
_COMPLETIONS = "completions"  # the loop's data for the epoll set of the links' channels


class VerbsTransport(LinkHostBase, Transport):
    """The verbs data plane on one device and GID index.

    ``options.poster`` picks how WR chains are posted (:mod:`kvbeam.transport.verbs.chain`):
    "auto" (the compiled helper where it loads, else pyverbs objects), "compiled" or
    "pyverbs".
    """

    kind = "rdma"

    def __init__(self, device: str, gid_index: int = 0,
                 options: TransportOptions | None = None, *,
                 loop: DaemonLoop | None = None) -> None:
        """Open ``device`` at ``gid_index``; serve on ``loop`` (the daemon's), or on a loop
        thread of its own (``kvbeam-verbs-<device>``) when none is given."""
        try:
            import_pyverbs()
        except ImportError as exc:
            raise TransportError(f"the RDMA transport needs pyverbs (rdma-core's python3-pyverbs)"
                                 f": {exc}") from exc
        self.options = options or TransportOptions()
        self.device = VerbsDevice(device, gid_index)
        super().__init__()
        self._mrs: dict[int, list[Any]] = {}
        #: Registrations whose MRs grant remote write themselves (dma-buf: no windows).
        self._own_keys: set[int] = set()
        #: The memory window type links get (None: the REMOTE_WRITE MRs' own keys are shared).
        self._window_type = (self.device.window_type(self.options.qps_per_peer)
                             if self.options.per_link_keys else None)
        self._warned_shared = False  # the no-windows warning is logged once
        #: Per link id: (registration, that link's memory windows over it), registration order.
        self._grants: dict[int, list[tuple[Registration, list[Window]]]] = {}
        self._lock = threading.RLock()
        self._links: dict[int, VerbsLink] = {}
        self._next_id = 1
        self._poster = Poster(self.options.poster)
        self._closed = False
        # The loop's state (set by other threads only as whole bools: a wake-up).
        self._due = False  # a writer woke the loop, or a completion event came
        self._busy = False  # the last service did something: service again at once
        self._staged = False  # events queued on the loop, to deliver after its service
        self._next_at = float("inf")  # a link's deadline, or the back-off poll
        self._backoff = _BACKOFF_S[0]
        #: The live links' completion-channel fds (an epoll set of our own: see the module).
        self._channels = select.epoll()
        self._watched: dict[int, VerbsLink] = {}
        self._owns_loop = loop is None
        self._loop = loop or DaemonLoop(f"kvbeam-verbs-{device}")
        self._loop.run_sync(self._join)
        if self._owns_loop:
            self._loop.start()
        if self._poster.why and self.options.poster == "auto":
            log.warning("RDMA transport on %s (GID index %d): the compiled WR poster is not in "
                        "use (%s): posting WRs through pyverbs objects (slower; "
                        "docs/troubleshooting.md)", device, gid_index, self._poster.why)
        else:
            log.info("RDMA transport on %s (GID index %d), %s WR poster", device, gid_index,
                     self._poster.kind)

    @property
    def poster(self) -> str:
        """The WR poster in use: "compiled" or "pyverbs"."""
        return self._poster.kind

    def register(self, regions: Sequence[Region], access: Access) -> Registration:
        """One MR per region, the only registration of this memory; links get windows.

        With memory windows the MR grants no remote access at all, whatever ``access``
        says: peers write only through the windows of the link created for them
        (:meth:`create_link`). Without (``options.per_link_keys`` off, or a device
        without windows) the MR has ``access`` and every link advertises its key. The
        MRs are registered before the transport lock is taken (pinning a large pool
        is slow), then recorded under it.
        """
        for r in regions:
            if r.addr <= 0 or r.length <= 0:
                raise RegionError(f"cannot register {r}: address and length must be positive")
        windows = self._window_type is not None and access is Access.REMOTE_WRITE
        if (access is Access.REMOTE_WRITE and self.options.per_link_keys and not windows
                and not self._warned_shared):
            self._warned_shared = True
            log.warning("RDMA device %s has no memory windows: every peer gets the same "
                        "remote-write keys of the pools, valid until the daemon stops "
                        "(per-peer keys need memory windows; docs/security.md)",
                        self.device.name)
        shared = Access.LOCAL if windows else access
        mrs: list[Any] = []
        try:
            for r in regions:
                mrs.append(self.device.register(r.addr, r.length, shared, windows=windows))
            with self._lock:
                if self._closed:
                    raise TransportError("transport is closed")
                reg = self._book.add(regions, access, [mr.lkey for mr in mrs],
                                     [mr.rkey for mr in mrs], self._deregister)
                self._mrs[id(reg)] = mrs
        except BaseException:
            for mr in mrs:
                mr.close()
            raise
        return reg

    def register_dmabuf(self, regions: Sequence[DmaBufRegion], access: Access) -> Registration:
        """One ``ibv_reg_dmabuf_mr`` MR per dma-buf region, addressed from its iova.

        No memory windows over them (a window binds to a pyverbs MR): a REMOTE_WRITE
        dma-buf MR grants remote write itself and every link advertises its key, as on
        a device without windows. Registered before the transport lock is taken.
        TransportError when the device refuses (rdma_rxe: not supported).
        """
        for r in regions:
            if r.iova <= 0 or r.length <= 0 or r.offset < 0:
                raise RegionError(f"cannot register {r}: iova and length must be positive")
        mrs: list[DmaBufMR] = []
        try:
            for r in regions:
                mrs.append(DmaBufMR(self.device.pd, r.fd, r.offset, r.length, r.iova,
                                    access is Access.REMOTE_WRITE, self.device.name))
            with self._lock:
                if self._closed:
                    raise TransportError("transport is closed")
                reg = self._book.add([r.region for r in regions], access,
                                     [mr.lkey for mr in mrs], [mr.rkey for mr in mrs],
                                     self._deregister)
                self._mrs[id(reg)] = list(mrs)
                self._own_keys.add(id(reg))
        except BaseException:
            for mr in mrs:
                mr.close()
            raise
        if access is Access.REMOTE_WRITE and self._window_type is not None:
            log.warning("dma-buf memory on %s: its MRs grant remote write themselves (memory "
                        "windows bind to host MRs only): every peer gets the same keys",
                        self.device.name)
        return reg

    def create_link(self) -> VerbsLink:
        """New RC QPs (``options.qps_per_peer``) and the link's own memory windows; its
        endpoint (with the windows' keys) goes into the handshake.

        Registers no memory: the windows lie over the pools' one registration and are
        bound when the link connects. They are allocated (and the QPs created) before
        the transport lock is taken.
        """
        if self._closed:
            raise TransportError("transport is closed")
        start = time.monotonic()
        # QPs before windows: a killed process's verbs objects are destroyed newest
        # first, and rxe's QP destroy waits (20 s) for a type-2 window still bound to
        # it; windows created after their QP go first and let go of it.
        qps: list[QueuePair] = []
        grants: list[tuple[Registration, list[Window]]] = []
        try:
            for _ in range(self.options.qps_per_peer):
                qps.append(QueuePair(self.device, self.options))
                qps[-1].psn = qps[0].psn  # one PSN in the endpoint for all of them
            grants = self._grant()
        except BaseException:
            _close_grants(grants)
            for qp in qps:
                qp.close()
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                # A registration released while we registered over it: its keys go now.
                live = {id(reg) for reg in self._book.all()}
                stale = [g for g in grants if id(g[0]) not in live]
                grants = [g for g in grants if id(g[0]) in live]
                link = VerbsLink(self, self._next_id, qps)
                self._next_id += 1
                self._grants[link.id] = grants
                self._links[link.id] = link
        if closed:
            for qp in qps:
                qp.close()
            _close_grants(grants)
            raise TransportError("transport is closed")
        _close_grants(stale)
        if grants:
            log.info("link %d: own memory windows (type %s) for %d regions (%d MiB) in "
                     "%.3f s", link.id, self._window_type, sum(len(m) for _, m in grants),
                     sum(r.length for reg, _ in grants for r in reg.regions) >> 20,
                     time.monotonic() - start)
        return link

    def template_endpoint(self) -> Endpoint:
        """The device's GID and MTU and no keys; its QPN is 1 (the GSI QP of every
        port), which no RC QP can connect to: there is no link behind it."""
        return Endpoint(kind="rdma", regions=(), gid=self.device.gid,
                        qpns=(1,) * self.options.qps_per_peer, psn=0,
                        mtu=mtu_bytes(self.device.mtu), address=self.device.name)

    def link_regions(self, link_id: int) -> tuple[RemoteRegion, ...]:
        """The remote-writable regions with the rkeys of link ``link_id`` only (empty once
        it is released: its keys are revoked)."""
        if self._window_type is None:
            return self._book.remote_regions()
        with self._lock:
            windows = {id(reg): w for reg, w in self._grants.get(link_id, ())}
            out: list[RemoteRegion] = []
            for reg in self._book.all():  # registration order, as without windows
                if id(reg) in self._own_keys:
                    if reg.access is Access.REMOTE_WRITE:
                        out += reg.remote
                elif id(reg) in windows:
                    out += [RemoteRegion(r.addr, r.length, w.rkey)
                            for r, w in zip(reg.regions, windows[id(reg)], strict=True)]
            return tuple(out)

    def _grant(self) -> list[tuple[Registration, list[Window]]]:
        """Memory windows over every REMOTE_WRITE registration, for one new link.

        Runs without the transport lock, over a snapshot of the registrations.
        """
        grants: list[tuple[Registration, list[Window]]] = []
        mw_type = self._window_type
        if mw_type is None:
            return grants
        with self._lock:
            snapshot = [(reg, self._mrs[id(reg)]) for reg in self._book.all()
                        if reg.access is Access.REMOTE_WRITE and id(reg) in self._mrs
                        and id(reg) not in self._own_keys]
        try:
            for reg, mrs in snapshot:
                windows: list[Window] = []
                grants.append((reg, windows))
                for r, mr in zip(reg.regions, mrs, strict=True):
                    windows.append(Window(self.device, mr, r.addr, r.length, mw_type))
        except BaseException:
            _close_grants(grants)
            raise
        return grants

    def stats(self) -> TransportStats:
        """Counters: bytes and WRs sent, completions, QP errors, WRs in flight.

        No received bytes: RDMA WRITEs land without this side's CPU seeing them.
        """
        with self._lock:
            links = list(self._links.values())
        return self._meter.snapshot(links=len(links), wrs=True,
                                    inflight_wrs=sum(link.outstanding for link in links))

    def close(self) -> None:
        """Leave the loop, destroy links, deregister memory, close the device."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Off the loop first (on its thread: no service runs as the links go).
        with contextlib.suppress(TimeoutError):
            leave_loop(self._loop, self, self._owns_loop)
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.release()
        for reg in self._book.all():
            reg.release()
        self.device.close()
        self._channels.close()

    # -- VerbsHost: what links use -------------------------------------------------------
    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The transport lock (see the module docstring for the lock order)."""
        return self._lock

    def posted(self, wrs: int) -> None:
        """Count posted WRs."""
        self._meter.posted(wrs)

    def forget(self, link_id: int) -> None:
        """Drop a released link; the loop stops servicing it."""
        with self._lock:
            self._links.pop(link_id, None)
        self.wake()

    def wake(self) -> None:
        """Work is queued: service the links at the end of the loop's current pass (on
        the loop thread) or at its next (any other thread)."""
        self._due = True
        self._loop.poke(self)

    def bind(self, link_id: int, qps: Sequence[QueuePair]) -> None:
        """Bind link ``link_id``'s memory windows through its first QP, now connected
        (called by the link under the transport lock, before it is serviced)."""
        windows = [w for _, ws in self._grants.get(link_id, ()) for w in ws]
        if not windows:
            return
        start = time.monotonic()
        bind_windows(qps[0], windows, self.options.op_timeout_s)
        log.debug("link %d: %d memory windows bound in %.4f s", link_id, len(windows),
                  time.monotonic() - start)

    def revoke(self, link_id: int) -> None:
        """Deallocate a link's memory windows: a write with their keys now fails remotely.

        Called by the link under the transport lock, before it destroys its QPs
        (deallocating a window is one cheap verbs call, no deregistration).
        """
        with self._lock:
            grants = self._grants.pop(link_id, [])
            _close_grants(grants)
        if grants:
            log.debug("link %d: %d memory windows revoked", link_id,
                      sum(len(m) for _, m in grants))

    def _deregister(self, reg: Registration) -> None:
        doomed: list[tuple[Registration, list[Window]]] = []
        with self._lock:
            self._book.remove(reg)
            for grants in self._grants.values():  # links' keys over it go first
                doomed += [g for g in grants if g[0] is reg]
                grants[:] = [g for g in grants if g[0] is not reg]
            mrs = self._mrs.pop(id(reg), [])
            self._own_keys.discard(id(reg))
        _close_grants(doomed)  # windows first: an MR with windows bound cannot go
        for mr in mrs:
            mr.close()

    def emit(self, event: Event) -> None:
        """Count and queue an event. The loop's (it may hold the transport lock) are
        staged and delivered on the loop once its service is over; any other thread's
        wake the loop to deliver them."""
        if self._loop.on_loop:
            self._staged = True
            self.stage(event)
            self._loop.poke(self)
        else:
            super().emit(event)

    # -- the loop's source -----------------------------------------------------------------
    def _join(self) -> None:
        """Become a source of the loop, watching the links' epoll set (on its thread)."""
        sel = self._loop.add(self)
        sel.register(self._channels.fileno(), selectors.EVENT_READ, _COMPLETIONS)

    def ready(self, data: object, mask: int) -> None:
        """A completion channel has an event: take it (so it can fire again), service."""
        for fd, _ in self._channels.poll(0):
            link = self._watched.get(fd)
            with self._lock:
                taken = link is not None and link.active
                if link is not None and taken:
                    self._take_event(link, fd)
            if not taken:  # released meanwhile: watched no more (the set is level-triggered)
                self._watched.pop(fd, None)
                with contextlib.suppress(OSError):
                    self._channels.unregister(fd)
        self._due = True
        self._loop.poke(self)

    def tick(self, now: float) -> float:
        """Service the links when work is due (see the module); deliver the events.
        Due again at once while the service finds work, else at a link's deadline or
        the back-off poll (a writer's wake-up or a completion event pokes the loop)."""
        if self._closed:
            return math.inf
        if not (self._due or self._busy or self._staged or now >= self._next_at):
            return self._next_at
        self._due = False
        try:
            self._busy = self._cycle(now)
            if not self._busy:
                self._busy = self._arm(time.monotonic())
        except Exception:  # a bug here must not silently stop every transfer
            log.exception("RDMA progress error; continuing")
            self._busy, self._next_at = False, time.monotonic() + _BACKOFF_S[1]
        if self._staged:
            self._staged = False
            self.deliver()
        return now if self._busy else self._next_at

    def _cycle(self, now: float) -> bool:
        with self._lock:
            return any([self._service(link, now) for link in list(self._links.values())])

    def _service(self, link: VerbsLink, now: float) -> bool:
        try:
            return link.service(self._poster, now)
        except Exception as exc:  # e.g. a pyverbs error from poll: this link is unusable
            log.exception("RDMA link %d: progress failed", link.id)
            link.abort(f"progress error: {exc!r}")
            return True

    def _arm(self, now: float) -> bool:
        """Nothing happened: arm the CQs, look once more (a completion that came before
        arming raises no event), watch the live links' channels and set when the loop
        must look again without one (a link's deadline; the back-off poll of a link
        with no channel fd). True when the last look found work after all."""
        with self._lock:
            links = [link for link in self._links.values() if link.active]
            for link in links:
                link.arm()
            if any([self._service(link, now) for link in links]):
                self._backoff = _BACKOFF_S[0]
                return True
            fds: dict[int, VerbsLink] = {}
            polled = False  # a link with a QP that has no event fd: poll with back-off
            for link in links:
                link_fds = link.event_fds
                polled = polled or link_fds is None
                fds.update((fd, link) for fd in link_fds or ())
            next_at = float("inf")
            for link in links:
                deadline = link.deadline()
                if deadline is not None:
                    next_at = min(next_at, deadline + 1e-3)
            if polled:
                next_at = min(next_at, now + self._backoff)
                self._backoff = min(self._backoff * 2, _BACKOFF_S[1])
            else:
                self._backoff = _BACKOFF_S[0]
            self._next_at = next_at
        self._watch(fds)
        return False

    def _watch(self, fds: dict[int, VerbsLink]) -> None:
        """Make the epoll set watch exactly ``fds`` (the loop's thread)."""
        if fds == self._watched:
            return
        for fd in self._watched.keys() - fds.keys():
            with contextlib.suppress(OSError):  # closed already: the kernel dropped it
                self._channels.unregister(fd)
        for fd, link in fds.items():
            if self._watched.get(fd) is link:
                continue
            with contextlib.suppress(OSError):  # a reused number, still in the set
                self._channels.unregister(fd)
            self._channels.register(fd, select.EPOLLIN)
        self._watched = dict(fds)

    def _take_event(self, link: VerbsLink, fd: int) -> None:
        try:
            link.take_event(fd)
        except Exception:  # non-blocking fd with no event after all: harmless
            log.debug("link %d: no completion event to take", link.id, exc_info=True)


def _close_grants(grants: Sequence[tuple[Registration, list[Window]]]) -> None:
    for _, windows in grants:
        for window in windows:
            window.close()
