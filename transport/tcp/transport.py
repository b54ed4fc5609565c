"""TCP transport: the same interface for hosts without RDMA.

Each side listens on one port. A link's outbound connection carries its writes:
each transfer is one stream of WRITEV frames (up to IOV_MAX blocks each: their
destination addresses and lengths, then the payloads, read straight from local
memory; see :mod:`kvbeam.transport.tcp.wire`) and its END frame, sent by ``writev``:
a small one by the writing thread while the link is idle, the rest by the link's
sender thread (what the socket did not take at once, large transfers, and what queued
behind them). The receiver checks
every block against its remote-writable regions before it lands the bytes, straight
from the socket into the destination, and answers END with ACK (after emitting the
notification) or NAK (a block was refused). The writer's COMPLETED event follows
ACK/NAK, so it means what an RDMA completion means.

Links (:mod:`kvbeam.transport.tcp.link`) reach this transport only through its
:class:`~kvbeam.transport.tcp.link.TcpHost` methods. Lock order: see
:mod:`kvbeam.transport.verbs.transport`, which lists every lock of kvbeam.transport.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence

from kvbeam.errors import RegionError, TransportError
from kvbeam.threads import name_os_thread
from kvbeam.transport import status as st
from kvbeam.transport.base import Access, Event, EventKind, Registration, Transport
from kvbeam.transport.core import blocks_helper, wait_readable
from kvbeam.transport.endpoint import Endpoint, Region, RemoteRegion
from kvbeam.transport.host import LinkHostBase
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.stats import TransportStats
from kvbeam.transport.tcp import iov, wire
from kvbeam.transport.tcp.link import TICK_S, TcpLink

log = logging.getLogger(__name__)
#: One WRITEV descriptor: destination address, length (little-endian u64).
_DESC = struct.Struct("<QQ")

#: Inbound connections that have not yet named a link (HELLO) held at once; over it the
#: oldest is dropped. They cost a socket each, no thread.
MAX_UNAUTHENTICATED = 64
#: How long a new inbound connection has to send its HELLO (a peer sends it right
#: after connecting, in its first packet).
HELLO_TIMEOUT_S = 5.0
_MAX_TOKEN = 256  # longest token a HELLO may carry (ours are 32 characters)
_CAP_LOG_EVERY_S = 10.0  # at most one log line per this long about the cap


class TcpTransport(LinkHostBase, Transport):
    """Listens on ``host:port`` (port 0: any free port) and serves links over TCP."""

    kind = "tcp"

    def __init__(self, host: str | None = None, port: int = 0,
                 options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()
        self.host = host or os.environ.get("KVBEAM_TCP_HOST", "127.0.0.1")
        self._listener = socket.create_server((self.host, port))
        self.port = int(self._listener.getsockname()[1])
        super().__init__()
        self._lock = threading.Lock()
        self._links: dict[int, TcpLink] = {}
        self._by_token: dict[str, TcpLink] = {}
        self._next_id = 1
        self._closed = threading.Event()
        self._dropped = 0  # connections dropped over MAX_UNAUTHENTICATED (accept thread)
        self._dropped_logged = -_CAP_LOG_EVERY_S
        # Before the thread starts: close() may run before it gets to its first line.
        self._listener.setblocking(False)
        self._accepter = threading.Thread(target=self._accept_loop, name="kvbeam-tcp-accept",
                                          daemon=True)
        self._accepter.start()
        log.warning("kvbeam data plane is TCP on %s:%d, not RDMA: no RDMA device is in use, "
                    "so KV bytes go through the kernel socket stack at a fraction of RDMA "
                    "bandwidth", self.host, self.port)

    def register(self, regions: Sequence[Region], access: Access) -> Registration:
        """Record regions (TCP needs no keys: they are 0)."""
        zeros = [0] * len(regions)
        return self._book.add(regions, access, zeros, zeros, self._book.remove)

    def create_link(self) -> TcpLink:
        """A new link; its endpoint carries our address and a token naming the link."""
        with self._lock:
            if self._closed.is_set():
                raise TransportError("transport is closed")
            link = TcpLink(self, self._next_id, secrets.token_hex(16))
            self._next_id += 1
            self._links[link.id] = link
            self._by_token[link.token] = link
        return link

    def template_endpoint(self) -> Endpoint:
        """Our address without a link token (a link refuses to connect to it)."""
        return Endpoint(kind="tcp", regions=(), address=self.address)

    def stats(self) -> TransportStats:
        """Counters: bytes sent (ACKed) and received (landed here), completions, failures."""
        with self._lock:
            links = len(self._links)
        return self._meter.snapshot(links=links, received=True)

    def close(self) -> None:
        """Stop listening, release every link and registration."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.release()
        self._listener.close()
        self._accepter.join(timeout=2 * TICK_S + 1)
        for reg in self._book.all():
            reg.release()

    # -- LinkHost: what links (and the receivers below) use -------------------------
    @property
    def address(self) -> str:
        """``host:port`` of our listener."""
        return f"{self.host}:{self.port}"

    def link_regions(self, link_id: int) -> tuple[RemoteRegion, ...]:
        """Every remote-writable region: TCP links share them (the token names the link)."""
        return self._book.remote_regions()

    def forget(self, link_id: int) -> None:
        """Drop a released link and its token: the token now names nothing."""
        with self._lock:
            link = self._links.pop(link_id, None)
            if link is not None:
                self._by_token.pop(link.token, None)

    def received(self, nbytes: int) -> None:
        """Count bytes that landed in our regions."""
        self._meter.received(nbytes)

    def writable(self) -> RegionTable:
        """Our remote-writable regions: where inbound WRITEV blocks may land."""
        return self._book.writable

    def _accept_loop(self) -> None:
        """Accept inbound connections and read their HELLO; only then give one a thread.

        Until a connection names a live link it is one non-blocking socket in
        ``pending`` (this thread's alone), polled with the listener: at most
        :data:`MAX_UNAUTHENTICATED` of them, each dropped after :data:`HELLO_TIMEOUT_S`.
        """
        name_os_thread()
        pending: dict[int, _Pending] = {}
        try:
            listener = self._listener.fileno()
        except OSError:  # closed before this thread ran
            return
        if listener < 0:
            return
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                timeout = min([TICK_S, *(max(0.0, c.deadline - now) for c in pending.values())])
                try:
                    ready = wait_readable([listener, *pending], timeout)
                except (OSError, ValueError):
                    if self._closed.is_set():
                        return
                    log.exception("TCP transport: waiting for connections failed")
                    continue
                for fd in ready:
                    if fd == listener:
                        if not self._accept_new(pending):
                            return
                    elif fd in pending:
                        self._read_hello(pending, pending[fd])
                self._expire(pending, time.monotonic())
        finally:
            for conn in pending.values():
                conn.sock.close()

    def _accept_new(self, pending: dict[int, _Pending]) -> bool:
        """Accept what the listener has queued (False once the transport is closed)."""
        for _ in range(MAX_UNAUTHENTICATED):  # then look at the pending ones again
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return True
            except (OSError, ValueError):
                if self._closed.is_set():
                    return False
                log.exception("TCP transport: accept failed")
                return True
            sock.setblocking(False)
            if len(pending) >= MAX_UNAUTHENTICATED:
                # A peer's HELLO follows its connect at once: the connection waiting
                # longest is the least likely to be one.
                oldest = pending.pop(next(iter(pending)))
                oldest.sock.close()
                self._over_cap(oldest.peer)
            conn = _Pending(sock, peer, time.monotonic() + HELLO_TIMEOUT_S)
            pending[sock.fileno()] = conn
            self._read_hello(pending, conn)  # often already here
        return True

    def _over_cap(self, peer: object) -> None:
        """Count (and now and then log) a connection dropped because of the cap."""
        self._dropped += 1
        now = time.monotonic()
        if now - self._dropped_logged >= _CAP_LOG_EVERY_S:
            self._dropped_logged = now
            log.warning("TCP transport: %d unauthenticated inbound connections (no HELLO "
                        "yet) already open, the most allowed: dropped the oldest, from %s "
                        "(%d dropped so far). Something is opening connections to the data "
                        "port that are not a kvbeam peer's", MAX_UNAUTHENTICATED, peer,
                        self._dropped)

    def _read_hello(self, pending: dict[int, _Pending], conn: _Pending) -> None:
        """Read what has arrived of ``conn``'s HELLO; a complete one gets its link's thread."""
        try:
            data = conn.sock.recv(conn.missing())
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(pending, conn, logging.INFO, f"failed before its HELLO: {exc}")
            return
        if not data:
            self._drop(pending, conn, logging.DEBUG, "closed before its HELLO")
            return
        conn.buf += data
        if len(conn.buf) == wire.HEADER.size:
            kind, _, _, _, _, length = wire.HEADER.unpack(conn.buf)
            if kind != wire.HELLO or not 0 < length <= _MAX_TOKEN:
                self._drop(pending, conn, logging.WARNING, "sent no HELLO")
                return
            conn.token_length = length
        if conn.missing():
            return
        token = conn.buf[wire.HEADER.size:].decode("ascii", "replace")
        with self._lock:
            link = self._by_token.get(token)
        if link is None:
            self._drop(pending, conn, logging.WARNING, "named no link of ours")
            return
        del pending[conn.sock.fileno()]
        conn.sock.setblocking(True)
        conn.sock.settimeout(self.options.op_timeout_s)
        threading.Thread(target=self._serve, args=(conn.sock, conn.peer, link), daemon=True,
                         name=f"kvbeam-tcp-recv-{conn.peer}").start()

    def _drop(self, pending: dict[int, _Pending], conn: _Pending, level: int, why: str) -> None:
        del pending[conn.sock.fileno()]
        conn.sock.close()
        log.log(level, "TCP transport: inbound connection from %s %s; dropped it", conn.peer, why)

    def _expire(self, pending: dict[int, _Pending], now: float) -> None:
        for conn in [c for c in pending.values() if c.deadline <= now]:
            self._drop(pending, conn, logging.INFO,
                       f"sent no HELLO within {HELLO_TIMEOUT_S:g} s")

    def _serve(self, conn: socket.socket, peer: object, link: TcpLink) -> None:
        """Receive side of one inbound connection that named ``link``: WRITEV*/END frames."""
        name_os_thread()
        try:
            link.add_inbound(conn)
            try:
                _Receiver(self, link, conn).run()
            finally:
                link.discard_inbound(conn)
        except (OSError, ConnectionError) as exc:
            if not self._closed.is_set():
                log.info("TCP transport: inbound connection from %s ended: %s", peer, exc)
        finally:
            conn.close()


class _Pending:
    """An inbound connection that has not completed its HELLO (accept thread only)."""

    __slots__ = ("buf", "deadline", "peer", "sock", "token_length")

    def __init__(self, sock: socket.socket, peer: object, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.buf = bytearray()
        self.token_length: int | None = None  # known once the header is in

    def missing(self) -> int:
        """Bytes of the HELLO (header, then token) still to read."""
        if self.token_length is None:
            return wire.HEADER.size - len(self.buf)
        return wire.HEADER.size + self.token_length - len(self.buf)


class _Receiver:
    """Lands WRITEV frames of one inbound connection and answers each END."""

    def __init__(self, transport: TcpTransport, link: TcpLink, conn: socket.socket) -> None:
        self.t, self.link, self.conn = transport, link, conn

    def run(self) -> None:
        refused: str | None = None  # why the transfer being received was refused
        in_transfer = False
        landed = 0  # bytes of the transfer being received (counted once, at END)
        while True:
            try:
                header = wire.recv_header(self.conn)
            except (OSError, ConnectionError) as exc:
                header, eof_reason = None, str(exc)
            else:
                eof_reason = "peer closed the connection"
            if header is None:
                if in_transfer and self.link.live:
                    self._link_failed(None, st.TCP_CONNECTION_LOST,
                                      f"{eof_reason} in the middle of a transfer")
                return
            kind, flags, transfer_id, _addr, length = header
            if kind == wire.WRITEV:
                in_transfer = True
                landed, refused = self._writev(length, landed, refused)
            elif kind == wire.END:
                in_transfer = False
                self.t.received(landed)
                landed = 0
                if refused is not None:
                    detail = refused.encode()
                    wire.send_all(self.conn, wire.frame(wire.NAK, transfer_id, 0, len(detail))
                                  + detail)
                    self._link_failed(transfer_id, st.TCP_REMOTE_ACCESS_ERR, refused)
                    return
                if flags & wire.FLAG_NOTIFY:  # handled on this thread once the ACK is out
                    self.t.stage(Event(EventKind.NOTIFIED, self.link.id, transfer_id))
                wire.send_all(self.conn, wire.frame(wire.ACK, transfer_id))
                if flags & wire.FLAG_NOTIFY:
                    self.t.deliver()
            else:
                log.warning("TCP transport: unknown frame kind %d; dropping the connection", kind)
                return

    def _writev(self, count: int, landed: int, refused: str | None) -> tuple[int, str | None]:
        """Land one WRITEV frame's blocks; (bytes landed so far, why refused or None).

        The blocks before the first one outside our regions land, that one and every
        later one are read and dropped (and the transfer is NAKed at its END).
        """
        helper = blocks_helper()
        if helper is not None:  # the same checks in one compiled call
            raw = wire.recv_desc_bytes(self.conn, count)
            starts, ends, _keys = self.t.writable().arrays
            ok, ok_bytes, rest = helper.check_descs(raw, starts, ends)
            if refused is not None:  # an earlier frame's block was refused: drop it all
                ok, ok_bytes, rest = 0, 0, ok_bytes + rest
            elif ok < count:
                addr, length = _DESC.unpack_from(raw, 16 * ok)
                refused = (f"block at {addr:#x} length {length} is outside every "
                           f"remote-writable region of the receiver")
            if ok:
                iov.Vectors.from_iov(raw, ok_bytes, count=ok).move(self.conn, reading=True)
            if rest:
                wire.discard(self.conn, rest)
            return landed + ok_bytes, refused
        addrs, lengths = wire.recv_descs(self.conn, count)
        table = self.t.writable()  # read per frame: registrations may change between transfers
        ok = count if refused is None else 0
        if ok:
            try:  # one vectorised check for the whole frame; per block only on a refusal
                table.lookup(addrs, lengths)
            except RegionError:
                ok = next(i for i, (a, n) in enumerate(zip(addrs.tolist(), lengths.tolist(),
                                                           strict=True))
                          if not table.contains(a, n))
                refused = (f"block at {int(addrs[ok]):#x} length {int(lengths[ok])} is outside "
                           f"every remote-writable region of the receiver")
        iov.transfer(self.conn, addrs[:ok], lengths[:ok], reading=True)
        wire.discard(self.conn, int(lengths[ok:].sum()))
        return landed + int(lengths[:ok].sum()), refused

    def _link_failed(self, transfer_id: int | None, status: str, detail: str) -> None:
        log.warning("TCP transport: link %d: %s: %s", self.link.id, status, detail)
        self.t.link_failed(status)
        self.t.emit(Event(EventKind.LINK_FAILED, self.link.id, transfer_id, False, status, detail))


