"""One TCP link: an outbound connection for our writes, ACK/NAK turned into events.

See :mod:`kvbeam.transport.tcp.transport` for the wire protocol and the data plane's
one thread, and :mod:`kvbeam.transport.verbs.transport` for the lock order of every
lock in kvbeam.transport (a link's ``_lock`` is taken before the transport's, never
after).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvbeam.errors import TransportError
from kvbeam.loop import SourceSelector
from kvbeam.transport import status as st
from kvbeam.transport.base import Event, EventKind, Link
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import prepare, remote_table
from kvbeam.transport.endpoint import Endpoint
from kvbeam.transport.host import LinkHost
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.tcp import iov, wire

log = logging.getLogger(__name__)

TICK_S = 0.25  # how often the data plane's thread looks at deadlines
#: Transfers up to this many bytes are sent by the writing thread when the link is idle;
#: larger ones go to the data plane's thread at once. A loopback socket keeps taking
#: bytes as fast as its reader drains them, so "what it takes without waiting" can be a
#: whole large transfer: tens of milliseconds of copying on a channel's or a handler's
#: thread.
INLINE_SEND_BYTES = 1 << 20


class TcpHost(LinkHost, Protocol):
    """What a TCP link needs from its transport beyond :class:`LinkHost`."""

    @property
    def address(self) -> str:
        """``host:port`` of the transport's listener, where peers connect."""

    @property
    def selector(self) -> SourceSelector:
        """The data plane's selector (its thread only): what a link registers with
        itself as data comes back to its ``ready``."""

    def on_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the data plane's thread (at once when the caller is that
        thread, or the thread has stopped)."""


class TcpLink(Link):
    """One peer over TCP: an outbound connection for our writes, watched by the data
    plane's thread, which streams what writers queued and turns ACK/NAK into events.

    A write of at most :data:`INLINE_SEND_BYTES` made while the connection is idle is sent
    by the writing thread itself, as far as the socket takes it without waiting (a small
    request's whole transfer, END included, in one ``writev``); the data plane's thread
    finishes what is left (the socket's writability wakes it), streams larger transfers
    and what queued behind them. So a small request costs no thread hand-off here, and
    no thread ever waits on the socket. One stream owns the socket's sending side at a
    time (``_streaming``), so transfers never interleave; ``_inflight`` holds every
    transfer from its write until its ACK, in order (ACKs come in that order).
    """

    def __init__(self, host: TcpHost, link_id: int, token: str) -> None:
        self.id = link_id
        self.token = token
        self._t = host
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._peer: RegionTable | None = None
        self._pending: deque[_Stream] = deque()  # written, not yet streaming, in order
        self._streaming = False  # a thread is sending a stream (a writer or the loop)
        self._inflight: deque[int] = deque()  # written, ACK awaited, in order
        self._progress = time.monotonic()
        self._failure: tuple[str, str] | None = None
        self._released = False
        self._connecting = False  # connect() is dialling, without the lock
        self._inbound: set[socket.socket] = set()
        # The data plane thread's own: whether the socket is registered and watched for
        # writing too, and the ACK/NAK frame being read.
        self._close_after_stream = False  # close_socket came while a writer streamed
        self._watched = False
        self._writing = False
        self._head = bytearray(wire.HEADER.size)
        self._head_at = 0
        self._nak: bytearray | None = None  # a NAK's text being read
        self._nak_at = 0

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
            sock.setblocking(False)
            self._peer, self._sock = table, sock
        self._t.on_loop(self._watch)

    def write(self, transfer_id: int, blocks: Blocks, notify: bool = True) -> None:
        """Check and slice the blocks; a small transfer (:data:`INLINE_SEND_BYTES`) is sent
        here while the connection is idle, as far as the socket takes it without waiting;
        the rest, and every other transfer, is queued for the data plane's thread."""
        peer = self._usable_peer()
        prepared = prepare(transfer_id, blocks, notify, self._t.options.slice_bytes,
                           self._t.local_keys(), peer)
        stream = _Stream(transfer_id, wire.transfer_stream(
            transfer_id, prepared.src, prepared.dst, prepared.lengths, notify))
        with self._lock:  # checked again under the lock that _fail drains the queue under
            self._usable_peer()
            # Counted before sending: the ACK (and its event) may follow at once.
            self._t.submitted(self.id, transfer_id, blocks.total_bytes, len(blocks))
            if not self._inflight:  # the stall clock starts now, not at the last ACK
                self._progress = time.monotonic()  # of an idle link
            self._inflight.append(transfer_id)  # from here a failure reports it
            inline = not (self._streaming or self._pending
                          or stream.vectors.total > INLINE_SEND_BYTES)
            if inline:
                self._streaming = True  # this thread sends it
            else:
                self._pending.append(stream)
                kick = not self._streaming  # else the stream's owner kicks when done
        if inline:
            self._send_inline(stream)
        elif kick:
            self._t.on_loop(self._pump)

    def release(self) -> None:
        """Close both directions; queued transfers fail with CANCELLED."""
        with self._lock:
            if self._released:
                return
            self._released = True
            dropped = self._drain_locked()
        self._finish(dropped, st.CANCELLED, "link released", quiet=True)
        for conn in list(self._inbound):
            # Shut down, not closed: its receiver, on the data plane's thread, sees the end
            # and closes it there (a socket closed elsewhere could leave its fd number
            # registered in the selector while a new socket reuses it).
            _shut_down(conn)
        self._t.forget(self.id)

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

    # -- the data plane's thread -----------------------------------------------------

    def ready(self, mask: int) -> None:
        """The socket is readable (ACK/NAK, or the peer closed it) or writable (room for
        what is queued)."""
        if mask & selectors.EVENT_READ:
            self._read_answers()
        if mask & selectors.EVENT_WRITE and self.live:
            self._pump()

    def check_stall(self, now: float) -> None:
        """Fail the link when a written transfer saw no progress (bytes out or an ACK)
        within the operation timeout."""
        timeout = self._t.options.op_timeout_s
        if self._inflight and self.live and now - self._progress > timeout:
            self._fail(st.TIMEOUT, f"no acknowledgement within {timeout:g} s")

    def close_socket(self) -> None:
        """Stop watching the outbound socket and close it (after a failure or release,
        and at the transport's close). While a writer streams on it, that writer closes
        it when done (its fd must not be reused under a writev)."""
        with self._lock:
            if self._streaming:
                self._close_after_stream = True
                return
            sock, self._sock = self._sock, None
        if sock is not None:
            self._unwatch(sock)

    def _watch(self) -> None:
        """The connection is up: watch it for answers (and for room, if writers queued)."""
        sock = self._sock
        if sock is None or self._watched:
            return
        if not self.live:
            self._unwatch(sock)
            return
        self._t.selector.register(sock, selectors.EVENT_READ, self)
        self._watched = True
        self._pump()

    def _unwatch(self, sock: socket.socket) -> None:
        if self._watched:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._t.selector.unregister(sock)
            self._watched = False
        sock.close()

    def _want_room(self, on: bool) -> None:
        """Watch the socket for writability while a stream waits for room."""
        sock = self._sock
        if sock is None or not self._watched or on == self._writing:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        try:
            self._t.selector.modify(sock, events, self)
        except (KeyError, ValueError, OSError):
            return
        self._writing = on

    def _pump(self) -> None:
        """Stream what is queued as far as the socket takes it; what is left waits for
        the socket's room. A writer streaming inline kicks this again when it is done."""
        sock = self._sock
        if sock is None or not self._watched:
            return  # _watch pumps once the connection is watched
        while True:
            with self._lock:
                if not self.live or self._streaming or not self._pending:
                    more = False
                    break
                stream = self._pending.popleft()
                self._streaming = True
            if not self._move(sock, stream):
                return
            with self._lock:
                if not stream.vectors.done < stream.vectors.total:
                    continue
                more = True
                break
        self._want_room(more)

    def _move(self, sock: socket.socket, stream: _Stream) -> bool:
        """Send what the socket takes now of ``stream`` (the caller owns the sending side);
        what is left goes back to the head of the queue. False when the link failed
        (every transfer in flight is reported failed, this one included)."""
        try:
            done = stream.vectors.move(sock, reading=False, progress=self._progressed)
        except (OSError, ConnectionError) as exc:
            with self._lock:
                self._streaming = False
                close, self._close_after_stream = self._close_after_stream, False
            self._fail(st.TCP_CONNECTION_LOST, f"sending to the peer: {exc}")
            if close:
                self._t.on_loop(self.close_socket)
            return False
        with self._lock:
            self._streaming = False
            if not self.live:  # failed or released meanwhile, and already reported
                close, self._close_after_stream = self._close_after_stream, False
                if close:
                    self._t.on_loop(self.close_socket)
                return False
            if not done:
                self._pending.appendleft(stream)
        self._progress = time.monotonic()
        return True

    def _read_answers(self) -> None:
        """Read the ACK and NAK frames the socket holds (non-blocking)."""
        sock = self._sock
        if sock is None:
            return
        try:
            while self.live:
                if self._nak is not None:
                    self._nak_at = wire.fill(sock, self._nak, self._nak_at)
                    if self._nak_at < len(self._nak):
                        return
                    # The refused transfer heads _inflight; it and all after it fail.
                    self._fail(st.TCP_REMOTE_ACCESS_ERR,
                               bytes(self._nak).decode("utf-8", "replace"))
                    return
                self._head_at = wire.fill(sock, self._head, self._head_at)
                if self._head_at < len(self._head):
                    return
                self._head_at = 0
                kind, _, _, transfer_id, _, length = wire.HEADER.unpack(self._head)
                if kind == wire.ACK:
                    self._acked(transfer_id)
                elif kind == wire.NAK:
                    if not 0 <= length <= wire.MAX_NAK:
                        raise ConnectionError(f"NAK of {length} bytes")
                    self._nak = bytearray(length)
                else:
                    raise ConnectionError(f"unexpected frame kind {kind} from the receiver")
        except EOFError:
            self._fail(st.TCP_CONNECTION_LOST, "peer closed the connection")
        except (OSError, ConnectionError, ValueError) as exc:
            if self.live:
                self._fail(st.TCP_CONNECTION_LOST, f"reading from the peer: {exc}")

    def _acked(self, transfer_id: int) -> None:
        with self._lock:
            if self._inflight and self._inflight[0] == transfer_id:
                self._inflight.popleft()
            else:
                raise ConnectionError(f"unexpected ACK for transfer {transfer_id}")
        self._progress = time.monotonic()
        # Handled here, on the thread that read the ACK (no lock held).
        self._t.stage(Event(EventKind.COMPLETED, self.id, transfer_id, True, st.OK))
        self._t.deliver()

    # -- internals -------------------------------------------------------------------

    def _send_inline(self, stream: _Stream) -> None:
        """The writer sends its own small transfer (it owns the sending side); what the
        socket did not take, and what queued meanwhile, goes to the data plane's thread."""
        sock = self._sock
        if sock is None:
            with self._lock:
                self._streaming = False
            return
        if not self._move(sock, stream):
            return
        with self._lock:
            kick = bool(self._pending)
        if kick:
            self._t.on_loop(self._pump)

    def _usable_peer(self) -> RegionTable:
        if self._failure is not None:
            status, detail = self._failure
            raise TransportError(f"link {self.id} failed ({status}: {detail}); "
                                 "create a new link and handshake again", status)
        if self._released or self._peer is None or self._sock is None:
            raise TransportError(f"link {self.id} is not connected")
        return self._peer

    def _drain_locked(self) -> list[int]:
        """Every transfer written and not acknowledged (queued, streaming or sent)."""
        dropped = list(self._inflight)
        self._inflight.clear()
        self._pending.clear()
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
        sock = self._sock
        if sock is not None:
            _shut_down(sock)
            self._t.on_loop(self.close_socket)  # the selector's: closed on its thread
        for transfer_id in dropped:
            self._t.emit(Event(EventKind.COMPLETED, self.id, transfer_id, False, status, detail))
        if not dropped and not quiet:
            self._t.emit(Event(EventKind.LINK_FAILED, self.id, None, False, status, detail))

    def _progressed(self) -> None:
        self._progress = time.monotonic()


class _Stream:
    """One written transfer on its way out: its id and its bytes (frames and END)."""

    __slots__ = ("transfer_id", "vectors")

    def __init__(self, transfer_id: int, vectors: iov.Vectors) -> None:
        self.transfer_id = transfer_id
        self.vectors = vectors


def _shut_down(sock: socket.socket) -> None:
    """End both directions (the peer sees EOF; our reader on the loop closes the socket)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _shutdown(sock: socket.socket) -> None:
    _shut_down(sock)
    sock.close()
