"""What one daemon owns: pools, transport, registration, control server, transfer table.

:class:`Runtime` builds everything in order (config, layout and the start-up
check before any memory is allocated), runs the background loops (transport
events, deadlines, heartbeats) and tears everything down in reverse order.
The role-specific behaviour lives in the role's core (:mod:`kvbeam.server.core`),
reached through its servicer (:mod:`kvbeam.server.decode`, :mod:`kvbeam.server.prefill`),
which the loops call back.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, cast

from kvbeam import __version__
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.checks import check_target_draft
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import load_side_config
from kvbeam.proto.side import Role, SideInfo
from kvbeam.server.control import ControlServer
from kvbeam.server.faults import FaultHooks
from kvbeam.server.lifecycle import Deadlines, TransferTable
from kvbeam.server.metrics import DaemonMetrics
from kvbeam.server.metrics_collector import DaemonCollector, Sources
from kvbeam.server.peers import Peers
from kvbeam.server.settings import ControlOptions, DaemonSettings
from kvbeam.server.slots import SlotPool
from kvbeam.transport import Access, TransportOptions, open_transport
from kvbeam.transport.factory import Kind as TransportKind

if TYPE_CHECKING:
    from kvbeam.server.daemon_servicer import DaemonServicer

log = logging.getLogger(__name__)

#: How often the deadline sweeper runs, seconds: deadlines are enforced to this precision.
SWEEP_S = 0.2


class Runtime:
    """A daemon's resources. Construct, :meth:`start` with a servicer, :meth:`stop`."""

    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.role = Role(settings.role)
        self.config = load_side_config(settings.config)
        self.layout = build_side_layout(self.config)
        # Refuse broken pools before allocating hundreds of MB or opening a device.
        check_target_draft(self.layout, self.role.value)
        self.faults = FaultHooks.from_env()  # test-only; all off unless KVBEAM_FAULT_* set
        self.pools = AllocatedSide(self.layout, settings.pool_device)
        if settings.fill_seed >= 0:
            self.pools.fill_pattern(settings.fill_seed)
        host = settings.data_host or settings.advertised.rpartition(":")[0]
        self.transport = open_transport(
            cast(TransportKind, settings.transport), settings.rdma_device or None,
            settings.rdma_gid_index,
            options=TransportOptions(op_timeout_s=self.transport_timeout(),
                                     per_link_keys=settings.per_peer_rkeys,
                                     qp_timeout=settings.rdma_qp_timeout,
                                     retry_cnt=settings.rdma_retry_cnt),
            tcp_host=host if host not in ("0.0.0.0", "::", "[::]") else None)
        log.info("%s daemon: %s transport%s", self.role.value, self.transport.kind,
                 "" if self.transport.kind == "rdma" else
                 " (NO RDMA DEVICE: data moves over TCP, far slower than RDMA)")
        access = Access.REMOTE_WRITE if self.role is Role.DECODE else Access.LOCAL
        self.registration = self.transport.register(self.pools.tensor_regions(), access)
        self.metrics = DaemonMetrics(self.role.value)
        self.table = TransferTable(
            Deadlines(settings.deadline_bootstrap_s, settings.deadline_waiting_s,
                      settings.deadline_transfer_s),
            capacity=settings.max_inflight, on_change=self.metrics.on_change)
        #: The one registry of verified peers and their connections (both roles).
        self.peers = Peers()
        self.options = ControlOptions(rpc_timeout_s=settings.rpc_timeout_s,
                                      security=settings.security)
        # The handshake carries a per-peer endpoint; this template only gives the
        # SideInfo (and the start-up check) a real one of this transport's kind.
        template = self.transport.create_link()
        self.local = SideInfo(self.role, self.layout, template.endpoint,
                              control_address=settings.advertise)
        template.release()
        self.server: ControlServer | None = None
        #: Where /metrics is served ("" when --metrics is off); set by :meth:`start`.
        self.metrics_address = ""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def transport_timeout(self) -> float:
        """The transport's own deadline for a write: below Transferring's, so a stuck
        write fails with its verbs status before the state deadline fires."""
        return max(0.5, 0.8 * self.settings.deadline_transfer_s)

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` began."""
        return self._stop.is_set()

    def start(self, servicer: DaemonServicer) -> str:
        """Serve the control plane and start the background loops; returns the bound address.

        With ``--metrics`` the /metrics endpoint starts first, so a port clash stops
        the daemon before it serves anything.
        """
        if self.settings.metrics:
            self.metrics_address = self.metrics.serve(self.settings.metrics)
        self.server = ControlServer(self.local, servicer=servicer, options=self.options)
        # The server fixes our advertised address (hostname:port for a wildcard listen
        # without --advertise) before it answers the first call.
        address = self.server.start(self.settings.listen)
        self.local = self.server.local  # carries the bound or advertised address
        self._publish(servicer)
        for name, target in (("events", servicer.event_loop), ("sweeper", self._sweep),
                             ("heartbeat", servicer.heartbeat_loop)):
            t = threading.Thread(target=target, args=(self._stop,), name=f"kvbeam-{name}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        self._servicer = servicer
        return address

    def _publish(self, servicer: DaemonServicer) -> None:
        """Register the scrape-time collector now that the servicer's books exist."""
        slots = getattr(servicer, "slots", None)
        pool = slots if isinstance(slots, SlotPool) else None
        self.metrics.registry.register(DaemonCollector(Sources(
            info={"role": self.role.value, "instance": self.local.instance_id,
                  "transport": self.transport.kind, "version": __version__},
            transport=self.transport.stats,
            live=self.table.live,
            peers=lambda: len(self.peers.all()),
            slots=None if pool is None else (lambda: (pool.held, pool.size)))))

    def _sweep(self, stop: threading.Event) -> None:
        while not stop.wait(SWEEP_S):
            try:
                self._servicer.sweep()
            except Exception:  # the sweeper must survive any one bad transfer
                log.exception("deadline sweep failed")

    def stop(self, grace: float = 2.0) -> None:
        """Fail live transfers (reason shutdown), stop serving, release everything."""
        if self._stop.is_set():
            return
        log.info("%s daemon shutting down", self.role.value)
        servicer = getattr(self, "_servicer", None)
        if servicer is not None:
            servicer.shutdown()
        self._stop.set()
        if self.server is not None:
            self.server.stop(grace)
        for t in self._threads:
            t.join(timeout=5)
        for conn in self.peers.all():
            conn.close()
        self.metrics.stop()
        self.registration.release()
        self.transport.close()
        log.info("%s daemon stopped: nothing registered, transport closed", self.role.value)
