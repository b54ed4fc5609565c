"""What one daemon owns: pools, transport, registration, control server, transfer table.

:class:`Runtime` builds everything in order (config, layout and the start-up
check before any memory is allocated), runs the events thread (the transport events no
transport thread delivered, and the sweep every ``SWEEP_S``: deadlines, peers without a
channel, the cores' periodic work, the end-of-transfer lines; the peer channels and the
attach server have their own) and tears everything down in reverse order.
The role-specific behaviour lives in the role's core (:mod:`kvbeam.server.core`),
reached through its servicer (:mod:`kvbeam.server.api.decode`, :mod:`kvbeam.server.api.prefill`),
which the loops call back.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from kvbeam import __version__
from kvbeam.errors import NoEngineAttached
from kvbeam.loop import DaemonLoop
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.checks import check_target_draft
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.mailbox import RecordArea, record_bytes
from kvbeam.pools.shm import unmap
from kvbeam.pools.spec import PoolSpec, SideConfig, load_side_config
from kvbeam.proto.attach_codec import AttachRequest
from kvbeam.proto.side import Role, SideInfo
from kvbeam.server.api.control import HEALTH_SERVICES, ControlServer
from kvbeam.server.api.servicer import GatedHealth
from kvbeam.server.end_log import EndLog
from kvbeam.server.engines.attach import AttachServer, PeerCred, default_socket_path
from kvbeam.server.engines.channel import CoreOps, EngineChannel
from kvbeam.server.engines.dmabuf import DmabufAccess
from kvbeam.server.engines.memory import map_engine_memory
from kvbeam.server.engines.pools import UNATTACHED_LAYOUT, AttachGauges, Pools, release
from kvbeam.server.faults import arm, build_faults
from kvbeam.server.metrics import DaemonMetrics
from kvbeam.server.metrics_collector import DaemonCollector, Sources
from kvbeam.server.settings import ControlOptions, DaemonSettings
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import Peers
from kvbeam.server.state.slots import SlotPool
from kvbeam.states import TransferStatus
from kvbeam.transport import Access, Endpoint, TransportOptions, open_transport
from kvbeam.transport.base import Registration
from kvbeam.transport.factory import Kind as TransportKind

if TYPE_CHECKING:
    from kvbeam.server.api.daemon import DaemonServicer
    from kvbeam.server.core.decode_driver import DecodeDriver
    from kvbeam.server.core.prefill_driver import PrefillDriver

log = logging.getLogger(__name__)

#: How often the events thread sweeps, seconds: deadlines are enforced to this precision.
SWEEP_S = 0.2


def _slot_pool(core: object) -> SlotPool | None:
    pool = getattr(core, "slots", None)
    return pool if isinstance(pool, SlotPool) else None


class Runtime:
    """A daemon's resources. Construct, :meth:`start` with a servicer, :meth:`stop`."""

    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.role = Role(settings.role)
        #: --pools engine: the memory is an engine's, attached at run time
        #: (kvbeam.server.engines.attach).
        self.engine_mode = settings.pools == "engine"
        #: --config: what an attaching engine's config must equal (None: any valid one).
        self.expected = load_side_config(settings.config) if settings.config else None
        layout = build_side_layout(self.expected) if self.expected is not None else None
        if layout is not None:
            # Refuse broken pools before allocating hundreds of MB or opening a device.
            check_target_draft(layout, self.role.value)
        #: Test-only fault hooks: None unless --enable-fault-injection (logged here);
        #: :meth:`start` arms them around the servicer's driver, the one place they enter.
        self.faults = build_faults(settings.enable_fault_injection)
        self._pools: Pools | None = None
        self.attach_server: AttachServer | None = None
        self.gauges: AttachGauges | None = None  # engine mode only
        #: --pools own: the pools allocated here, which :meth:`start` installs as an
        #: engine's attach installs its memory (None once installed, or engine mode).
        self._own: AllocatedSide | None = None
        if not self.engine_mode and self.expected is not None and layout is not None:
            self._own = AllocatedSide(layout, settings.pool_device)
            if settings.fill_seed >= 0:
                self._own.fill_pattern(settings.fill_seed)
        host = settings.data_host or settings.advertised.rpartition(":")[0]
        #: The daemon's loop: the peer channels, the attach socket and the engine
        #: channel, the transport (TCP's sockets; RDMA's posts, polls and completion
        #: events), the transport's leftover events and the sweep (:meth:`start`).
        self.loop = DaemonLoop("kvbeam-loop")
        self.transport = open_transport(
            cast(TransportKind, settings.transport), settings.rdma_device or None,
            settings.rdma_gid_index,
            options=TransportOptions(op_timeout_s=self.transport_timeout(),
                                     per_link_keys=settings.per_peer_rkeys,
                                     qp_timeout=settings.rdma_qp_timeout,
                                     retry_cnt=settings.rdma_retry_cnt,
                                     qps_per_peer=settings.qps_per_peer,
                                     poster=settings.rdma_poster),
            tcp_host=host if host not in ("0.0.0.0", "::", "[::]") else None, loop=self.loop)
        log.info("%s daemon: %s transport%s", self.role.value, self.transport.kind,
                 "" if self.transport.kind == "rdma" else
                 " (NO RDMA DEVICE: data moves over TCP, far slower than RDMA)")
        #: How an engine's ``memory_kind: dmabuf`` attach is taken (kvbeam.server.engines.dmabuf).
        self.dmabuf = DmabufAccess(self.transport, settings.integrity)
        #: The digest records' memory, the daemon's own (never an engine's):
        #: decode's mailbox (a slot per request slot, REMOTE_WRITE, advertised in the
        #: handshake) or prefill's staging slots (``--max-inflight``, LOCAL). Registered
        #: after the pools; an engine attach keeps it when its shape still fits.
        self.records: RecordArea | None = None
        self._records_reg: Registration | None = None
        self.metrics = DaemonMetrics(self.role.value)
        #: The daemon's clock (seconds, monotonic): its transfer table's deadlines, its
        #: peer channels' heartbeats and call deadlines, its sweep. Tests that build
        #: the parts without a daemon pass a clock they move.
        self.clock: Callable[[], float] = time.monotonic
        #: One line per ended transfer, written by the sweep (--log-ends-per-s).
        self.end_log = EndLog(settings.log_ends_per_s,
                              lambda rid: self._servicer.core.facts_of(rid),
                              "landed" if self.role is Role.DECODE else "written")
        self.table = TransferTable(
            Deadlines(settings.deadline_bootstrap_s, settings.deadline_waiting_s,
                      settings.deadline_transfer_s),
            capacity=settings.max_inflight, on_change=self._on_change)
        #: --pools engine: the attached engine's per-request channel (set by :meth:`start`).
        self.engine_channel: EngineChannel | None = None
        #: The one registry of verified peers and their connections (both roles).
        self.peers = Peers()
        self.options = ControlOptions(rpc_timeout_s=settings.rpc_timeout_s,
                                      security=settings.security)
        self.attach_path = settings.attach_socket or default_socket_path(
            self.role.value, settings.listen)
        #: Why transfers are refused while no engine is attached (updated on detach).
        self.no_engine = (f"no engine attached: this daemon runs with --pools engine and "
                          f"waits for an engine on {self.attach_path}")
        self.local = SideInfo(self.role, layout or UNATTACHED_LAYOUT, self._template_endpoint(),
                              control_address=settings.advertise)
        self.server: ControlServer | None = None
        self.health: GatedHealth | None = None
        #: Where /metrics is served ("" when --metrics is off); set by :meth:`start`.
        self.metrics_address = ""
        self._stop = threading.Event()
        #: Whether pools were installed in this daemon's life (a later attach is new
        #: memory).
        self._installed_before = False
        #: kvbeam_info's labels; ``instance`` follows a re-attach's new id.
        self.info = {"role": self.role.value, "instance": self.local.instance_id,
                     "transport": self.transport.kind, "version": __version__}

    def _on_change(self, snap: TransferStatus) -> None:
        """The transfer table's observer: metrics, the end-of-transfer line (queued) and
        the engine channel's pushes."""
        self.metrics.on_change(snap)
        if snap.state.terminal:
            self.end_log.ended(snap)
        channel = self.engine_channel
        if channel is not None:
            channel.on_change(snap)

    @property
    def access(self) -> Access:
        """How the pools are registered: decode's are written remotely."""
        return Access.REMOTE_WRITE if self.role is Role.DECODE else Access.LOCAL

    def _template_endpoint(self) -> Endpoint:
        # The handshake carries a per-peer endpoint; this template only gives the
        # SideInfo (and the start-up check) one of this transport's kind, without
        # creating a link (a QP and memory keys) to throw away.
        return self.transport.template_endpoint()

    # ---- the pools (own, or the attached engine's) ------------------------------------
    def _require(self) -> Pools:
        pools = self._pools
        if pools is None:
            raise NoEngineAttached(self.no_engine)
        return pools

    @property
    def attached(self) -> bool:
        """True while the daemon has pools (with --pools own: from :meth:`start` on)."""
        return self._pools is not None

    @property
    def config(self) -> SideConfig:
        """The pools' config; raises NoEngineAttached while an engine daemon has none."""
        return self._require().config

    @property
    def layout(self) -> SideLayout:
        """The pools' layout (see :attr:`config`)."""
        return self._require().layout

    @property
    def pools(self) -> AllocatedSide:
        """The pools (see :attr:`config`)."""
        return self._require().side

    def _fit_records(self, layout: SideLayout, spec: PoolSpec) -> RecordArea:
        """The digest records' area for this layout (kept when it still fits; else the
        old one is deregistered and a new one registered). Before any link of the
        pools exists: a link's endpoint (its rkeys) covers what was registered then."""
        slots = spec.num_req_slots if self.role is Role.DECODE else self.settings.max_inflight
        size = record_bytes(len(layout.flat_buffers))
        area = self.records
        if area is not None and (area.slots, area.record_bytes) == (max(1, slots), size):
            return area
        self._release_records()
        area = RecordArea(max(1, slots), size)
        try:
            self._records_reg = self.transport.register([area.region], self.access)
        except BaseException:
            area.close()
            raise
        self.records = area
        log.info("digest %s: %d slots of %d bytes registered", "mailbox"
                 if self.role is Role.DECODE else "record staging", area.slots, size)
        return area

    def _release_records(self) -> None:
        reg, self._records_reg = self._records_reg, None
        area, self.records = self.records, None
        if reg is not None:
            reg.release()  # waits for writes that use it
        if area is not None:
            area.close()

    def transport_timeout(self) -> float:
        """The transport's own deadline for a write: below Transferring's, so a stuck
        write fails with its verbs status before the state deadline fires."""
        return max(0.5, 0.8 * self.settings.deadline_transfer_s)

    def start(self, servicer: DaemonServicer, *, loop_here: bool = False) -> str:
        """Serve the control plane and start the daemon's loop; returns the bound address.

        ``loop_here``: the caller's thread is the loop's (no thread of its own) and serves
        it with ``self.loop.run()`` once this returns (what ``run_daemon`` does on the
        process's main thread); else the loop runs on a thread of its own.

        With ``--metrics`` the /metrics endpoint starts first, so a port clash stops
        the daemon before it serves anything. With ``--pools own`` the pools are
        registered and installed (:meth:`_install`) before the control server serves;
        with ``--pools engine`` the attach socket is bound before it, and health stays
        NOT_SERVING until an engine attaches.
        """
        if self.settings.metrics:
            self.metrics_address = self.metrics.serve(self.settings.metrics, self.loop)
        self.loop.start(thread=not loop_here)
        self._servicer = servicer
        # From now on the core is called on the loop only (a handler's or an executor
        # job's call is handed to it): server/core/base.py, DriverBase.on_loop.
        cast("DecodeDriver | PrefillDriver", servicer.core).loop = self.loop
        if self.faults is not None:  # decorate the driver before it serves anything
            arm(cast("DecodeDriver | PrefillDriver", servicer.core), self.faults)
        if self.engine_mode:
            self.gauges = AttachGauges(self.metrics.registry)
            self.engine_channel = EngineChannel(
                CoreOps(self.role.value,
                        lambda: cast("DecodeDriver | PrefillDriver", servicer.core),
                        lambda: self.config.target.max_context_len), servicer.io,
                failed_when_freed=self.role is Role.DECODE)
            if self.role is Role.DECODE:
                # A failed request's Failed goes to the engine once its pages are free.
                cast("DecodeDriver", servicer.core).on_freed = self.engine_channel.on_freed
            self.attach_server = AttachServer(self.attach_path, self.settings.attach_allow_uid,
                                              self.attach_engine, self.detach_engine,
                                              group=self.settings.attach_group,
                                              channel=self.engine_channel,
                                              offload=servicer.io.submit)
        own, self._own = self._own, None
        if own is not None and self.expected is not None:
            registration = self.transport.register(own.tensor_regions(), self.access)
            self._install(Pools(self.expected, own.layout, own, registration),
                          self._fit_records(own.layout, self.expected.target),
                          "own pools allocated", self.settings.pool_device)
        self.server = ControlServer(self.local, servicer=servicer, options=self.options)
        # SERVING only while pools exist (always with --pools own).
        self.health = self.server.health = GatedHealth(lambda: self.attached, HEALTH_SERVICES)
        # The server fixes our advertised address (hostname:port for a wildcard listen
        # without --advertise) before it answers the first call.
        address = self.server.start(self.settings.listen)
        self.local = self.server.local  # carries the bound or advertised address
        servicer.start_channels(self.loop)
        self._publish(servicer)
        servicer.deliver_events()
        events = _EventsAndSweeps(self)
        self.transport.wake_with(events.wake)
        self.loop.run_sync(lambda: self.loop.add(events))
        if self.attach_server is not None:
            self.attach_server.start(self.loop)
        return address

    # ---- engine attach (on the executor: the attach server offloads it) ----------------
    def attach_engine(self, req: AttachRequest, fds: list[int], cred: PeerCred) -> str:
        """Check and map an engine's memory, register it, serve it (:meth:`_install`).

        Returns the daemon's instance id.
        """
        memory = map_engine_memory(req, fds, self.role.value, self.expected,  # closes fds
                                   dmabuf=self.dmabuf)
        try:
            if memory.dmabuf is None:
                registration = self.transport.register(memory.side.tensor_regions(),
                                                       self.access)
            else:  # the fds are registered (RDMA) or their mappings (TCP); then closed
                try:
                    registration = self.dmabuf.register(memory.dmabuf, self.access)
                finally:
                    memory.dmabuf.close()
        except BaseException:
            unmap(memory.side.take_maps())
            raise
        try:
            records = self._fit_records(memory.layout, memory.config.target)
        except BaseException:
            registration.release()
            unmap(memory.side.take_maps())
            raise
        return self._install(Pools(memory.config, memory.layout, memory.side, registration),
                             records, f"engine pid {cred.pid} attached", req.memory_kind)

    def _install(self, pools: Pools, records: RecordArea, what: str, memory: str) -> str:
        """Serve ``pools`` (registered, ``records`` fitted to them) from now on: the
        daemon's own at start, or an attached engine's. The core gets the records' area,
        then the pools; the side is new. Returns the daemon's instance id: the first
        install keeps the id the daemon started with (its listening line's: no peer can
        have handshaken before, a daemon without memory refuses the handshake); an
        attach after a detach takes a new one, logged with both, so that peers that
        handshook against the old memory see a restart and handshake again.
        ``what`` and ``memory`` (its kind, or the own pools' device) go in the log line.
        """
        core = self._servicer.core
        if self.role is Role.DECODE:
            cast("DecodeDriver", core).use_mailbox(records)
        else:
            cast("PrefillDriver", core).use_staging(records)
        previous = self.local.instance_id
        local = SideInfo(self.role, pools.layout, self._template_endpoint(),
                         control_address=self.local.control_address)
        if not self._installed_before:
            local = dataclasses.replace(local, instance_id=previous)
        core.use_pools(pools.config.target, pools.layout, pools.side)
        self.local = self._servicer.local = local
        self._pools = pools
        self._installed_before = True
        self.info["instance"] = local.instance_id
        if self.gauges is not None:
            self.gauges.on_attach(pools)
        if self.health is not None:
            self.health.refresh()
        log.info("%s: %s, %d region(s) registered (%s, %s), instance %s", what,
                 pools.config.model, len(pools.registration.regions), self.transport.kind,
                 memory, local.instance_id)
        if local.instance_id != previous:
            log.info("instance id %s -> %s: an engine attached new memory after a detach; "
                     "peers that handshook with %s handshake again", previous,
                     local.instance_id, previous)
        return local.instance_id

    def detach_engine(self, reason: str) -> None:
        """Stop serving the engine's memory: fail its requests, deregister, unmap."""
        pools, self._pools = self._pools, None
        if pools is None:
            return
        self.no_engine = (f"no engine attached: this daemon runs with --pools engine and "
                          f"waits for an engine on {self.attach_path} (last: {reason})")
        if self.health is not None:
            self.health.refresh()
        # Fails every live request (peers are told, bounded), closes every peer
        # connection (their handshakes carried the old regions).
        self._servicer.core.drop_pools(f"engine memory detached: {reason}")
        left = release(pools)
        if self.gauges is not None:
            self.gauges.on_detach()
        log.info("engine memory released (%s): deregistered, %s", reason,
                 "unmapped" if not left else f"{left} mapping(s) still referenced")

    def slot_usage(self) -> tuple[int, int]:
        """Decode's request slots (held, total); (0, 0) on prefill or before serving."""
        # Read through the core each time: an engine attach gives decode new slots.
        servicer = getattr(self, "_servicer", None)
        pool = _slot_pool(servicer.core) if servicer is not None else None
        return (pool.held, pool.size) if pool is not None else (0, 0)

    def _publish(self, servicer: DaemonServicer) -> None:
        """Register the scrape-time collector now that the servicer's books exist."""
        core = servicer.core
        slots = self.slot_usage

        self.metrics.registry.register(DaemonCollector(Sources(
            info=self.info,
            transport=self.transport.stats,
            live=lambda: core.on_loop(self.table.live),  # the loop's table
            peers=lambda: len(self.peers.all()),
            slots=slots if _slot_pool(core) is not None else None,
            loop_stalls=lambda: self.loop.stalls)))

    def sweep(self) -> None:
        """Deadlines, peers without a channel, the cores' periodic work, then the
        end-of-transfer lines; a failure in one is logged and the next sweep goes on."""
        try:
            self._servicer.sweep()
        except Exception:  # the sweep must survive any one bad transfer
            log.exception("deadline sweep failed")
        try:
            self.end_log.flush()
        except Exception:  # a log line must never stop the sweeps
            log.exception("logging ended transfers failed")

    def stop(self, grace: float = 2.0) -> None:
        """Fail live transfers (reason shutdown), stop serving, release everything."""
        if self._stop.is_set():
            return
        log.info("%s daemon shutting down", self.role.value)
        if self.attach_server is not None:
            self.attach_server.stop()
        if self.engine_channel is not None:
            self.engine_channel.close()
        servicer = getattr(self, "_servicer", None)
        if servicer is not None:
            servicer.shutdown()
        self._stop.set()
        if self.server is not None:
            self.server.stop(grace)
        self.loop.stop()
        self.end_log.flush(final=True)  # the sweeps are over: the last ends' lines
        for conn in self.peers.all():
            conn.close()
        self.metrics.stop()
        pools, self._pools = self._pools, None
        if pools is not None:
            release(pools)
        self._release_records()
        self.transport.close()
        log.info("%s daemon stopped: nothing registered, transport closed", self.role.value)


class _EventsAndSweeps:
    """The loop's source for what no socket brings: the transport events no transport
    thread delivered (the transport wakes the loop for them,
    :meth:`~kvbeam.transport.base.Transport.wake_with`, which pokes this source), and
    every ``SWEEP_S`` on the runtime's clock the sweep (:meth:`Runtime.sweep`)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.due = runtime.clock() + SWEEP_S
        #: The transport queued an event for us (set from its threads: one bool).
        self.woken = False

    def wake(self) -> None:
        """The transport's waker (any thread): deliver at the loop's next pass."""
        self.woken = True
        self.rt.loop.poke(self)

    def ready(self, data: object, mask: int) -> None:
        """Never called: this source watches no file descriptor."""

    def tick(self, now: float) -> float:
        """Deliver what the transport queued, when it woke us or a sweep is due; sweep
        when one is due. Due again at the next sweep (on the runtime's clock, which
        tests move: counted from the loop's ``now``)."""
        clock = self.rt.clock()
        sweep = clock >= self.due
        if self.woken or sweep:
            self.woken = False  # before the pump: a wake-up during it is kept
            try:
                self.rt.transport.pump(0.0)
            except Exception:  # one bad event must not stop the deliveries
                log.exception("delivering transport events failed")
        if sweep:
            self.rt.sweep()
            clock = self.rt.clock()
            self.due = clock + SWEEP_S
        return now + min(SWEEP_S, max(0.0, self.due - clock))
