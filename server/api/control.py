"""The embeddable control server: the KvbeamControl servicer plus gRPC health, on one port.

The daemons build on :class:`ControlServer`: pass a :class:`ControlServicer`
subclass that implements the transfer RPCs, or override
:meth:`ControlServer.register_services` to add more services.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from concurrent import futures
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvbeam.errors import ListenError
from kvbeam.proto.service import add_control_servicer
from kvbeam.proto.side import SideInfo
from kvbeam.proto.version import SERVICE_NAME
from kvbeam.server.api.servicer import ControlServicer
from kvbeam.server.settings import ControlOptions
from kvbeam.server.state.handshake import check_local_side
from kvbeam.server.state.peers import Peers
from kvbeam.threads import name_os_thread

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.ServingStatus.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.ServingStatus.NOT_SERVING
#: Health is reported for the server as a whole ("") and for the kvbeam service.
HEALTH_SERVICES = ("", SERVICE_NAME)
_WILDCARD_HOSTS = {"0.0.0.0", "[::]", "::", ""}


class ControlServer:
    """A gRPC server running :class:`ControlServicer` and the standard health service.

    Args:
        local: our side. Checked at :meth:`start` (:func:`check_local_side`).
        servicer: the servicer to run (default: a plain :class:`ControlServicer`,
            which answers UNIMPLEMENTED for everything but Handshake).
        options: thread pool, size limits and authentication (``options.security``).
        startup_check: run :func:`check_local_side` at start. Only tests that need
            a deliberately broken peer turn it off.
    """

    def __init__(self, local: SideInfo, *, servicer: ControlServicer | None = None,
                 options: ControlOptions | None = None, startup_check: bool = True) -> None:
        self.servicer = servicer if servicer is not None else ControlServicer(local)
        self.servicer.local = local
        self.options = options or ControlOptions()
        self.servicer.security = self.options.security  # binds callers' claimed addresses
        self.startup_check = startup_check
        self.health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._address = ""
        self._lock = threading.Lock()
        for name in HEALTH_SERVICES:
            self.health.set(name, _NOT_SERVING)

    @property
    def local(self) -> SideInfo:
        """Our side as the servicer sends it."""
        return self.servicer.local

    @property
    def peers(self) -> Peers:
        """The verified peers."""
        return self.servicer.peers

    @property
    def address(self) -> str:
        """The bound ``host:port`` ("" before :meth:`start`)."""
        return self._address

    @property
    def port(self) -> int:
        """The bound port (0 before :meth:`start`)."""
        return int(self._address.rpartition(":")[2]) if self._address else 0

    def register_services(self, server: grpc.Server) -> None:
        """Add the services to ``server``; extend (and call super) to add more."""
        add_control_servicer(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)

    def start(self, address: str = "127.0.0.1:0") -> str:
        """Check our side, listen on ``address`` (port 0: any free port) and serve.

        When ``local.control_address`` is empty, the bound address becomes our
        advertised control address (``hostname:port`` for a wildcard host), before
        the server answers its first call.

        Returns:
            The bound ``host:port``.

        Raises:
            PoolCompatibilityError, ProtocolError: our own side is unusable.
            ListenError: the address cannot be bound (in use, bad host).
            ConfigError: a non-loopback address without authentication or
                ``insecure`` (:meth:`Security.check_bind`), or unreadable credentials.
        """
        with self._lock:
            if self._server is not None:
                raise RuntimeError("ControlServer.start() called twice")
            security = self.options.security
            security.check_bind(address)
            if self.startup_check:
                check_local_side(self.local)
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=self.options.max_workers,
                                           thread_name_prefix="kvbeam-control",
                                           initializer=name_os_thread),
                # SO_REUSEPORT would let a second daemon bind the same port and
                # silently receive half of the handshakes.
                options=[*self.options.grpc_options(), ("grpc.so_reuseport", 0)],
                interceptors=security.server_interceptors(),
            )
            try:
                self.register_services(server)
                self._address = self._bind(server, address)
                if self.startup_check:
                    self.servicer.prepare()
            except BaseException:
                server.stop(None)  # release the port and the thread pool
                self._address = ""
                raise
            server.start()
            security.warn_if_open(self._address)
            self._server = server
            for name in HEALTH_SERVICES:
                self.health.set(name, _SERVING)
        log.info("control server (%s, instance %s) listening on %s", self.local.role.value,
                 self.local.instance_id, self._address)
        return self._address

    def _bind(self, server: grpc.Server, address: str) -> str:
        """Bind ``address``; adopt the bound address as our control address if we have none."""
        creds = self.options.security.server_credentials()
        try:
            port = (server.add_insecure_port(address) if creds is None
                    else server.add_secure_port(address, creds))
        except RuntimeError as exc:
            raise ListenError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise ListenError(f"cannot listen on {address}: the port is in use or the "
                              "host is not a local address")
        host = address.rpartition(":")[0]
        bound = f"{host}:{port}"
        if not self.local.control_address:
            # Fixed here, before server.start(): a handshake answered meanwhile must
            # carry the address too. Bound to a wildcard, peers reach us by host name.
            advertised = bound
            if host in _WILDCARD_HOSTS:
                advertised = f"{socket.gethostname()}:{port}"
                log.warning("listening on %s without an advertised address: advertising %s "
                            "to peers", bound, advertised)
            self.servicer.local = dataclasses.replace(self.local, control_address=advertised)
        return bound

    def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, then stop; in-flight RPCs get ``grace`` seconds. Idempotent."""
        with self._lock:
            server, self._server = self._server, None
            for name in HEALTH_SERVICES:
                self.health.set(name, _NOT_SERVING)
        if server is not None:
            server.stop(grace).wait()
            log.info("control server on %s stopped", self._address)

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
