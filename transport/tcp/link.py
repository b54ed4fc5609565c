"""One TCP link: an outbound connection for our writes, ACK/NAK turned into events.

See :mod:`kvbeam.transport.tcp.transport` for the wire protocol, and
:mod:`kvbeam.transport.verbs.transport` for the lock order of every lock in
kvbeam.transport (a link's ``_lock`` is taken before the transport's, never after).
"""

from __future__ import annotations

import contextlib
import logging
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
from kvbeam.transport.core import prepare, remote_table, wait_readable
from kvbeam.transport.endpoint import Endpoint
from kvbeam.transport.host import LinkHost
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.tcp import iov, wire

log = logging.getLogger(__name__)

TICK_S = 0.25  # how often idle reader threads look at deadlines and the stop flag
#: Transfers up to this many bytes are sent by the writing thread when the link is idle;
#: larger ones go to the sender thread at once. A loopback socket keeps taking bytes as
#: fast as its reader drains them, so "what it takes without waiting" can be a whole
#: large transfer: tens of milliseconds of copying on a channel's or a handler's thread.
INLINE_SEND_BYTES = 1 << 20


class TcpHost(LinkHost, Protocol):
    """What a TCP link needs from its transport beyond :class:`LinkHost`."""

    @property
    def address(self) -> str:
        """``host:port`` of the transport's listener, where peers connect."""


class TcpLink(Link):
    """One peer over TCP: an outbound connection for our writes, with a sender thread
    that streams queued transfers and a reader thread that turns ACK/NAK into events.

    A write of at most :data:`INLINE_SEND_BYTES` made while the connection is idle is sent
    by the writing thread itself, as far as the socket takes it without waiting (a small
    request's whole transfer, END included, in one ``writev``); the sender thread
    finishes what is left, streams larger transfers and what queued behind them. So a
    small request costs no thread hand-off here, and no writer ever waits on the socket.
    One stream owns the socket's sending side at a time (``_streaming``), so transfers
    never interleave; ``_inflight`` holds every transfer from its write until its ACK,
    in order (ACKs come in that order).
    """

    def __init__(self, host: TcpHost, link_id: int, token: str) -> None:
        self.id = link_id
        self.token = token
        self._t = host
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._peer: RegionTable | None = None
        self._ready = threading.Condition(self._lock)  # the sender thread waits on it
        self._pending: deque[_Stream] = deque()  # written, not yet streaming, in order
        self._streaming = False  # a thread is sending a stream (the writer or the sender)
        self._inflight: deque[int] = deque()  # written, ACK awaited, in order
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
        """Check and slice the blocks; a small transfer (:data:`INLINE_SEND_BYTES`) is sent
        here while the connection is idle, as far as the socket takes it without waiting;
        the rest, and every other transfer, is queued for the sender thread."""
        peer = self._usable_peer()
        prepared = prepare(transfer_id, blocks, notify, self._t.options.slice_bytes,
                           self._t.local_keys(), peer)
        stream = _Stream(transfer_id, wire.transfer_stream(
            transfer_id, prepared.src, prepared.dst, prepared.lengths, notify))
        with self._lock:  # checked again under the lock that _fail drains the queue under
            self._usable_peer()
            # Counted before sending: the ACK (and its event) may follow at once.
            self._t.submitted(self.id, transfer_id, blocks.total_bytes, len(blocks))
            if not self._inflight:  # the reader's stall clock starts now, not at the
                self._progress = time.monotonic()  # last ACK of an idle link
            self._inflight.append(transfer_id)  # from here a failure reports it
            if self._streaming or self._pending or stream.vectors.total > INLINE_SEND_BYTES:
                self._pending.append(stream)
                self._ready.notify()
                return
            self._streaming = True
        self._send(stream, block=False)

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
        """Every transfer written and not acknowledged (queued, streaming or sent); wakes
        the sender thread, which stops (the link is no longer live)."""
        dropped = list(self._inflight)
        self._inflight.clear()
        self._pending.clear()
        self._ready.notify_all()
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
        """Stream what writers queued (and what a writer left when the socket was full)."""
        name_os_thread()
        while True:
            with self._lock:
                while self.live and (self._streaming or not self._pending):
                    self._ready.wait()
                if not self.live:
                    return
                stream = self._pending.popleft()
                self._streaming = True
            if not self._send(stream, block=True):
                return

    def _send(self, stream: _Stream, block: bool) -> bool:
        """Send ``stream`` (this thread owns the socket's sending side); ``block`` False:
        only what the socket takes now, the rest goes back to the head of the queue for
        the sender thread. False when the link failed (every transfer in flight is
        reported failed, this one included)."""
        sock = self._sock
        assert sock is not None
        try:
            done = stream.vectors.move(sock, reading=False, block=block,
                                       progress=self._progressed)
        except (OSError, ConnectionError) as exc:
            status = st.TIMEOUT if isinstance(exc, TimeoutError) else st.TCP_CONNECTION_LOST
            with self._lock:
                self._streaming = False
            self._fail(status, f"sending to the peer: {exc}")
            return False
        with self._lock:
            self._streaming = False
            if not self.live:  # failed or released meanwhile, and already reported
                return False
            if not done:
                self._pending.appendleft(stream)
            if self._pending:
                self._ready.notify()
        self._progress = time.monotonic()
        return True

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



class _Stream:
    """One written transfer on its way out: its id and its bytes (frames and END)."""

    __slots__ = ("transfer_id", "vectors")

    def __init__(self, transfer_id: int, vectors: iov.Vectors) -> None:
        self.transfer_id = transfer_id
        self.vectors = vectors


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
