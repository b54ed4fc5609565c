"""One TCP link: an outbound connection for our writes, ACK/NAK turned into events.

See :mod:`kvbeam.transport.tcp.transport` for the wire protocol, and
:mod:`kvbeam.transport.verbs.transport` for the lock order of every lock in
kvbeam.transport (a link's ``_lock`` is taken before the transport's, never after).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from typing import Protocol

from kvbeam.errors import TransportError
from kvbeam.threads import name_os_thread
from kvbeam.transport import status as st
from kvbeam.transport.base import Event, EventKind, Link
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import Prepared, prepare, remote_table, wait_readable
from kvbeam.transport.endpoint import Endpoint
from kvbeam.transport.host import LinkHost
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.tcp import wire

log = logging.getLogger(__name__)

TICK_S = 0.25  # how often idle reader threads look at deadlines and the stop flag


class TcpHost(LinkHost, Protocol):
    """What a TCP link needs from its transport beyond :class:`LinkHost`."""

    @property
    def address(self) -> str:
        """``host:port`` of the transport's listener, where peers connect."""


class TcpLink(Link):
    """One peer over TCP: an outbound connection for our writes, with a sender thread
    that streams queued transfers and a reader thread that turns ACK/NAK into events."""

    def __init__(self, host: TcpHost, link_id: int, token: str) -> None:
        self.id = link_id
        self.token = token
        self._t = host
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._peer: RegionTable | None = None
        self._queue: queue.SimpleQueue[Prepared | None] = queue.SimpleQueue()
        self._inflight: deque[int] = deque()  # END sent, ACK awaited, in order
        self._sending: int | None = None  # the transfer the sender thread is streaming
        self._progress = time.monotonic()
        self._failure: tuple[str, str] | None = None
        self._released = False
        self._connecting = False  # connect() is dialling, without the lock
        self._threads: list[threading.Thread] = []
        self._inbound: set[socket.socket] = set()

    @property
    def endpoint(self) -> Endpoint:
        """Our listening address, the token naming this link, our remote-writable regions."""
        return Endpoint(kind="tcp", regions=self._t.link_regions(self.id),
                        address=self._t.address, extra={"token": self.token})

    def connect(self, peer: Endpoint) -> None:
        """Open the outbound connection to the peer's listener and name its link."""
        if peer.kind != "tcp":
            raise TransportError(f"TCP link cannot connect to a {peer.kind!r} endpoint")
        token = peer.extra.get("token", "")
        host, _, port = peer.address.rpartition(":")
        if not token or not host or not port.isdigit():
            raise TransportError(f"TCP endpoint lacks address or token: {peer.address!r}")
        table = remote_table(peer.regions)
        with self._lock:
            if self._sock is not None or self._released or self._connecting:
                raise TransportError(f"link {self.id} is already connected or released")
            self._connecting = True
        try:  # the connection and HELLO go out without the lock: they may take op_timeout_s
            sock = socket.create_connection((host, int(port)), self._t.options.op_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.send_all(sock, wire.frame(wire.HELLO, length=len(token)) + token.encode())
        except OSError as exc:
            with self._lock:
                self._connecting = False
            raise TransportError(f"cannot connect to TCP peer {peer.address}: {exc}",
                                 st.TCP_CONNECTION_LOST) from exc
        with self._lock:
            self._connecting = False
            if self._released:
                _shutdown(sock)
                raise TransportError(f"link {self.id} was released while connecting")
            self._peer, self._sock = table, sock
            self._threads = [
                threading.Thread(target=self._send_loop, name=f"kvbeam-tcp-send-{self.id}",
                                 daemon=True),
                threading.Thread(target=self._ack_loop, name=f"kvbeam-tcp-ack-{self.id}",
                                 daemon=True)]
        for thread in self._threads:
            thread.start()

    def write(self, transfer_id: int, blocks: Blocks, notify: bool = True) -> None:
        """Check, slice and queue the blocks; the sender thread streams them."""
        peer = self._usable_peer()
        prepared = prepare(transfer_id, blocks, notify, self._t.options.slice_bytes,
                           self._t.local_keys(), peer)
        with self._lock:  # checked again under the lock that _fail drains the queue under
            self._usable_peer()
            # Counted before queueing: the ACK (and its event) may follow at once.
            self._t.submitted(self.id, transfer_id, blocks.total_bytes, len(blocks))
            self._queue.put(prepared)

    def release(self) -> None:
        """Close both directions; queued transfers fail with CANCELLED."""
        with self._lock:
            if self._released:
                return
            self._released = True
            dropped = self._drain_locked()
        self._finish(dropped, st.CANCELLED, "link released", quiet=True)
        for conn in list(self._inbound):
            _shutdown(conn)
        self._t.forget(self.id)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2 * TICK_S + 1)

    @property
    def live(self) -> bool:
        """Neither released nor failed."""
        return not self._released and self._failure is None

    def add_inbound(self, conn: socket.socket) -> None:
        """An inbound connection the peer opened for this link: shut down on release."""
        self._inbound.add(conn)

    def discard_inbound(self, conn: socket.socket) -> None:
        """The inbound connection ended."""
        self._inbound.discard(conn)

    # -- internals -------------------------------------------------------------------

    def _usable_peer(self) -> RegionTable:
        if self._failure is not None:
            status, detail = self._failure
            raise TransportError(f"link {self.id} failed ({status}: {detail}); "
                                 "create a new link and handshake again", status)
        if self._released or self._peer is None or self._sock is None:
            raise TransportError(f"link {self.id} is not connected")
        return self._peer

    def _drain_locked(self) -> list[int]:
        dropped = [] if self._sending is None else [self._sending]
        self._sending = None
        dropped += self._inflight
        self._inflight.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                dropped.append(item.transfer_id)
        self._queue.put(None)  # stops the sender thread
        return dropped

    def _fail(self, status: str, detail: str) -> None:
        with self._lock:
            if self._failure is not None or self._released:
                return
            self._failure = (status, detail)
            dropped = self._drain_locked()
        self._t.link_failed(status)
        # A peer that goes away between transfers is routine (it closed or restarted).
        log.log(logging.WARNING if dropped else logging.INFO, "TCP link %d failed: %s: %s",
                self.id, status, detail)
        self._finish(dropped, status, detail, quiet=False)

    def _finish(self, dropped: list[int], status: str, detail: str, quiet: bool) -> None:
        if self._sock is not None:
            _shutdown(self._sock)
        for transfer_id in dropped:
            self._t.emit(Event(EventKind.COMPLETED, self.id, transfer_id, False, status, detail))
        if not dropped and not quiet:
            self._t.emit(Event(EventKind.LINK_FAILED, self.id, None, False, status, detail))

    def _send_loop(self) -> None:
        name_os_thread()
        sock = self._sock
        assert sock is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._lock:
                # From here until END is sent the transfer is ours; a failure or release
                # meanwhile reports it (see _drain_locked), so it never goes missing.
                if not self.live:
                    self._finish([item.transfer_id], *(self._failure or (st.CANCELLED, "")),
                                 quiet=True)
                    return
                self._sending = item.transfer_id
            try:
                wire.send_writev(sock, item.src, item.dst, item.lengths, self._progressed)
                with self._lock:
                    if self._sending is None:  # failed meanwhile and already reported
                        return
                    self._sending = None
                    self._inflight.append(item.transfer_id)  # before END: the ACK may be quick
                flags = wire.FLAG_NOTIFY if item.notify else 0
                wire.send_all(sock, wire.frame(wire.END, item.transfer_id, flags=flags))
                self._progress = time.monotonic()
            except OSError as exc:
                status = st.TIMEOUT if isinstance(exc, TimeoutError) else st.TCP_CONNECTION_LOST
                self._fail(status, f"sending to the peer: {exc}")
                return

    def _progressed(self) -> None:
        self._progress = time.monotonic()

    def _ack_loop(self) -> None:
        name_os_thread()
        sock = self._sock
        assert sock is not None
        timeout = self._t.options.op_timeout_s
        while self.live:
            try:
                if not wait_readable([sock.fileno()], TICK_S):
                    if self._inflight and time.monotonic() - self._progress > timeout:
                        self._fail(st.TIMEOUT, f"no acknowledgement within {timeout:g} s")
                    continue
                header = wire.recv_header(sock)
                if header is None:
                    self._fail(st.TCP_CONNECTION_LOST, "peer closed the connection")
                    return
                kind, _, transfer_id, _, length = header
                if kind == wire.ACK:
                    with self._lock:
                        if self._inflight and self._inflight[0] == transfer_id:
                            self._inflight.popleft()
                        else:
                            raise ConnectionError(f"unexpected ACK for transfer {transfer_id}")
                    self._progress = time.monotonic()
                    # Handled here, on the thread that read the ACK (no lock held).
                    self._t.stage(Event(EventKind.COMPLETED, self.id, transfer_id, True, st.OK))
                    self._t.deliver()
                elif kind == wire.NAK:
                    # The refused transfer heads _inflight; it and all after it fail.
                    text = wire.recv_bytes(sock, length).decode("utf-8", "replace")
                    self._fail(st.TCP_REMOTE_ACCESS_ERR, text)
                    return
                else:
                    raise ConnectionError(f"unexpected frame kind {kind} from the receiver")
            except (OSError, ConnectionError, ValueError) as exc:
                if self.live:
                    self._fail(st.TCP_CONNECTION_LOST, f"reading from the peer: {exc}")
                return



def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
