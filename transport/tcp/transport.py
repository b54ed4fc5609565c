"""TCP transport: the same interface for hosts without RDMA.

Each side listens on one port. A link's outbound connection carries its writes:
each transfer is one stream of WRITEV frames (up to IOV_MAX blocks each: their
destination addresses and lengths, then the payloads, read straight from local
memory; see :mod:`kvbeam.transport.tcp.wire`) and its END frame, sent by ``writev``:
a small one by the writing thread while the link is idle, the rest by the data plane's
thread. The receiver checks every block against its remote-writable regions before it
lands the bytes, straight from the socket into the destination, and answers END with
ACK (after emitting the notification) or NAK (a block was refused). The writer's
COMPLETED event follows ACK/NAK, so it means what an RDMA completion means.

**One loop thread** serves the whole data plane, however many peers: the daemon's
(``kvbeam-loop``: ``open_transport(loop=...)``), or, for a transport built alone (a
unit test, a bench), a :class:`~kvbeam.loop.DaemonLoop` of its own (``kvbeam-tcp``). It
serves the listener, every inbound connection (its
HELLO, then its frames, read as they arrive into the destination memory: a partial
frame resumes where it stopped), and every link's outbound socket (its ACK/NAK, and the
queued streams whenever the socket has room), and every ``TICK_S`` the deadlines (a
HELLO not sent, a link with no progress). Nothing on it blocks: every socket is
non-blocking once connected (a link's dial and HELLO run on the caller's thread).

Links (:mod:`kvbeam.transport.tcp.link`) reach this transport only through its
:class:`~kvbeam.transport.tcp.link.TcpHost` methods. Lock order: see
:mod:`kvbeam.transport.verbs.transport`, which lists every lock of kvbeam.transport.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvbeam.errors import RegionError, TransportError
from kvbeam.loop import DaemonLoop, SourceSelector
from kvbeam.transport import status as st
from kvbeam.transport.base import Access, Event, EventKind, Registration, Transport
from kvbeam.transport.core import blocks_helper
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
                 options: TransportOptions | None = None, *,
                 loop: DaemonLoop | None = None) -> None:
        """Listen on ``host:port``; serve on ``loop`` (a daemon's, not started yet), or on
        a loop thread of its own (``kvbeam-tcp``) when none is given."""
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
        self._dropped = 0  # connections dropped over MAX_UNAUTHENTICATED (the loop's)
        self._dropped_logged = -_CAP_LOG_EVERY_S
        # The data plane's thread, and what only it touches: the connections that have
        # not sent their HELLO, the inbound ones that did, and the next tick.
        self._pending: dict[int, _Pending] = {}
        self._receivers: set[_Receiver] = set()
        self._next_tick = 0.0
        self._listener.setblocking(False)
        self._owns_loop = loop is None
        self._loop = loop or DaemonLoop("kvbeam-tcp")
        if self._loop.running:
            raise TransportError("the TCP transport joins a loop before it starts")
        self._sel = self._loop.add(self)
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        if self._owns_loop:
            self._loop.start()
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
        with contextlib.suppress(TimeoutError):
            self._loop.run_sync(lambda: self._close_sockets(links))
        if self._owns_loop:
            self._loop.stop()
        for reg in self._book.all():
            reg.release()

    def _close_sockets(self, links: list[TcpLink]) -> None:
        """Every socket of the data plane, closed on its thread."""
        for link in links:
            link.close_socket()
        for receiver in list(self._receivers):
            receiver.close()
        for conn in list(self._pending.values()):
            self._drop(conn, logging.DEBUG, "was open when the transport closed")
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._listener)
        self._listener.close()
        if not self._owns_loop:  # the daemon's loop serves on without us
            self._loop.remove(self)

    # -- LinkHost: what links (and the receivers below) use -------------------------
    @property
    def address(self) -> str:
        """``host:port`` of our listener."""
        return f"{self.host}:{self.port}"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed.is_set()

    @property
    def selector(self) -> SourceSelector:
        """The data plane's selector (its thread only)."""
        return self._sel

    def on_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the data plane's thread (at once on it, or once it stopped)."""
        if self._loop.on_loop or not self._loop.running:
            call()
        else:
            self._loop.call_soon_threadsafe(call)

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

    # -- the data plane's thread (a source of its DaemonLoop) ---------------------------
    def ready(self, data: Any, mask: int) -> None:
        """A socket is ready: the listener, a connection's HELLO, a receiver's frames or
        a link's answers and room."""
        if data is _LISTENER:
            self._accept_new()
        elif isinstance(data, _Pending):
            self._read_hello(data)
        else:
            data.ready(mask)

    def tick(self, now: float) -> float:
        """Every ``TICK_S``: HELLOs not sent in time, links and receivers stalled."""
        if now < self._next_tick:  # poked: nothing of ours is queued for the tick
            return self._next_tick
        self._next_tick = now + TICK_S
        self._expire(now)
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.check_stall(now)
        for receiver in list(self._receivers):
            receiver.check_stall(now)
        return self._next_tick

    def _accept_new(self) -> None:
        """Accept what the listener has queued; each connection waits for its HELLO
        (:data:`MAX_UNAUTHENTICATED` at most: over it the oldest is dropped), each a
        non-blocking socket, no thread."""
        pending = self._pending
        for _ in range(MAX_UNAUTHENTICATED):  # then serve the other sockets again
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except (OSError, ValueError):
                if not self._closed.is_set():
                    log.exception("TCP transport: accept failed")
                return
            sock.setblocking(False)
            if len(pending) >= MAX_UNAUTHENTICATED:
                # A peer's HELLO follows its connect at once: the connection waiting
                # longest is the least likely to be one.
                oldest = pending[next(iter(pending))]
                self._drop(oldest, logging.DEBUG, "was the oldest over the cap")
                self._over_cap(oldest.peer)
            conn = _Pending(sock, peer, time.monotonic() + HELLO_TIMEOUT_S)
            pending[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._read_hello(conn)  # often already here

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

    def _read_hello(self, conn: _Pending) -> None:
        """Read what has arrived of ``conn``'s HELLO; a complete one gets its receiver."""
        pending = self._pending
        if pending.get(conn.sock.fileno()) is not conn:
            return  # dropped in this pass already
        try:
            data = conn.sock.recv(conn.missing())
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(conn, logging.INFO, f"failed before its HELLO: {exc}")
            return
        if not data:
            self._drop(conn, logging.DEBUG, "closed before its HELLO")
            return
        conn.buf += data
        if len(conn.buf) == wire.HEADER.size:
            kind, _, _, _, _, length = wire.HEADER.unpack(conn.buf)
            if kind != wire.HELLO or not 0 < length <= _MAX_TOKEN:
                self._drop(conn, logging.WARNING, "sent no HELLO")
                return
            conn.token_length = length
        if conn.missing():
            return
        token = conn.buf[wire.HEADER.size:].decode("ascii", "replace")
        with self._lock:
            link = self._by_token.get(token)
        if link is None or not link.live:
            self._drop(conn, logging.WARNING, "named no link of ours")
            return
        del pending[conn.sock.fileno()]
        receiver = _Receiver(self, link, conn.sock, conn.peer)
        self._receivers.add(receiver)
        link.add_inbound(conn.sock)
        self._sel.modify(conn.sock, selectors.EVENT_READ, receiver)
        receiver.ready(selectors.EVENT_READ)  # frames may have come with the HELLO

    def _drop(self, conn: _Pending, level: int, why: str) -> None:
        self._pending.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        log.log(level, "TCP transport: inbound connection from %s %s; dropped it", conn.peer, why)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._pending.values() if c.deadline <= now]:
            self._drop(conn, logging.INFO, f"sent no HELLO within {HELLO_TIMEOUT_S:g} s")

    def receiver_closed(self, receiver: _Receiver) -> None:
        """An inbound connection ended (its receiver closed it)."""
        self._receivers.discard(receiver)


#: The listener's selector data.
_LISTENER = "listener"


class _Pending:
    """An inbound connection that has not completed its HELLO (the loop thread's)."""

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
    """One inbound connection that named a link: lands its WRITEV frames as they arrive
    and answers each END (the data plane's thread only; the socket is non-blocking).

    A frame is read in parts as bytes come: its header, its descriptors, then its
    payloads straight into the destinations (the blocks before the first one outside
    our regions land; that one and every later one of the transfer are read and
    dropped, and the transfer is NAKed at its END).
    """

    def __init__(self, transport: TcpTransport, link: TcpLink, conn: socket.socket,
                 peer: object) -> None:
        self.t, self.link, self.conn, self.peer = transport, link, conn, peer
        self._head = bytearray(wire.HEADER.size)
        self._descs: bytearray | None = None  # the WRITEV frame's descriptors, being read
        self._at = 0  # bytes of the header (or of the descriptors) read so far
        self._payload: iov.Vectors | None = None  # the blocks landing
        self._drop = 0  # bytes of refused blocks still to read and drop
        self._in_transfer = False  # a WRITEV came since the last END
        self._landed = 0  # bytes of the transfer being received (counted once, at END)
        self._refused: str | None = None  # why the transfer being received was refused
        self._out = bytearray()  # ACK/NAK frames the socket has not taken yet
        self._closing = False  # close once _out is sent (after a NAK)
        self._closed = False
        self._writing = False
        self._progress = time.monotonic()
        self._scratch: bytearray | None = None

    def ready(self, mask: int) -> None:
        """Readable: read what came (as many frames as it holds); writable: the rest of
        an answer."""
        if mask & selectors.EVENT_WRITE:
            self._flush()
        if mask & selectors.EVENT_READ and not self._closed:
            try:
                while not self._closed and self._step():
                    pass
            except (OSError, ConnectionError, EOFError) as exc:
                self._ended(str(exc) if not isinstance(exc, EOFError) else
                            "peer closed the connection", clean=isinstance(exc, EOFError))

    def check_stall(self, now: float) -> None:
        """A frame begun and no byte of it for the operation timeout: the connection goes
        (an idle connection between frames may wait as long as it likes)."""
        timeout = self.t.options.op_timeout_s
        if self._mid_frame() and now - self._progress > timeout:
            self._ended(f"no bytes of a frame within {timeout:g} s", clean=False)

    def close(self) -> None:
        """Stop watching the socket and close it."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.t.selector.unregister(self.conn)
        self.conn.close()
        self.link.discard_inbound(self.conn)
        self.t.receiver_closed(self)

    # -- reading ------------------------------------------------------------------------
    def _mid_frame(self) -> bool:
        return bool(self._at or self._descs is not None or self._payload is not None
                    or self._drop)

    def _progressed(self) -> None:
        self._progress = time.monotonic()

    def _step(self) -> bool:
        """Read the next part of a frame; False when the socket has nothing more now."""
        if self._payload is not None or self._drop:
            return self._read_payload()
        if self._descs is not None:
            self._at = wire.fill(self.conn, self._descs, self._at)
            if self._at < len(self._descs):
                return False
            self._progressed()
            self._at = 0
            raw, self._descs = self._descs, None
            self._check(raw)
            return True
        before = self._at
        self._at = wire.fill(self.conn, self._head, self._at)
        if self._at != before:
            self._progressed()
        if self._at < len(self._head):
            return False
        self._at = 0
        kind, flags, _, transfer_id, _addr, length = wire.HEADER.unpack(self._head)
        if kind == wire.WRITEV:
            if not 0 < length <= wire.MAX_VEC:
                raise ConnectionError(f"WRITEV frame with {length} blocks (at most "
                                      f"{wire.MAX_VEC})")
            self._in_transfer = True
            self._descs = bytearray(16 * length)
            return True
        if kind == wire.END:
            self._end(flags, transfer_id)
            return True
        log.warning("TCP transport: unknown frame kind %d; dropping the connection", kind)
        self.close()
        return False

    def _check(self, raw: bytearray) -> None:
        """A WRITEV frame's descriptors are in: which blocks land, which are dropped."""
        count = len(raw) // 16
        helper = blocks_helper()
        if helper is not None:  # the same checks in one compiled call
            starts, ends, _keys = self.t.writable().arrays
            ok, ok_bytes, rest = helper.check_descs(raw, starts, ends)
            if self._refused is not None:  # an earlier frame's block was refused: drop it all
                ok, ok_bytes, rest = 0, 0, ok_bytes + rest
            elif ok < count:
                addr, length = _DESC.unpack_from(raw, 16 * ok)
                self._refused = (f"block at {addr:#x} length {length} is outside every "
                                 f"remote-writable region of the receiver")
            if ok:
                self._payload = iov.Vectors.from_iov(raw, ok_bytes, count=ok)
            self._drop, self._landed = rest, self._landed + ok_bytes
            return
        pairs = np.frombuffer(raw, dtype="<u8").reshape(count, 2).astype(np.uint64)
        addrs, lengths = pairs[:, 0], pairs[:, 1]
        table = self.t.writable()  # read per frame: registrations may change between transfers
        ok = count if self._refused is None else 0
        if ok:
            try:  # one vectorised check for the whole frame; per block only on a refusal
                table.lookup(addrs, lengths)
            except RegionError:
                ok = next(i for i, (a, n) in enumerate(zip(addrs.tolist(), lengths.tolist(),
                                                           strict=True))
                          if not table.contains(a, n))
                self._refused = (f"block at {int(addrs[ok]):#x} length {int(lengths[ok])} "
                                 f"is outside every remote-writable region of the receiver")
        if ok:
            self._payload = iov.Vectors(addrs[:ok], lengths[:ok])
        landed = int(lengths[:ok].sum())
        self._drop, self._landed = int(lengths[ok:].sum()), self._landed + landed

    def _read_payload(self) -> bool:
        """Land the frame's blocks, then read and drop the refused ones."""
        if self._payload is not None:
            if not self._payload.move(self.conn, reading=True, progress=self._progressed):
                return False
            self._payload = None
        while self._drop:
            if self._scratch is None:
                self._scratch = bytearray(min(self._drop, 1 << 20))
            view = memoryview(self._scratch)[:min(self._drop, len(self._scratch))]
            try:
                n = self.conn.recv_into(view)
            except (BlockingIOError, InterruptedError):
                return False
            if n == 0:
                raise EOFError
            self._drop -= n
            self._progressed()
        return True

    def _end(self, flags: int, transfer_id: int) -> None:
        """A transfer's END: ACK it (its notification emitted first), or NAK it and end
        the connection when a block was refused."""
        self._in_transfer = False
        self.t.received(self._landed)
        self._landed = 0
        if self._refused is not None:
            detail = self._refused.encode()
            self._closing = True
            self._answer(wire.frame(wire.NAK, transfer_id, 0, len(detail)) + detail)
            self._link_failed(transfer_id, st.TCP_REMOTE_ACCESS_ERR, self._refused)
            return
        notify = flags & wire.FLAG_NOTIFY
        if notify:  # handled on this thread once the ACK is out
            self.t.stage(Event(EventKind.NOTIFIED, self.link.id, transfer_id))
        self._answer(wire.frame(wire.ACK, transfer_id))
        if notify:
            self.t.deliver()

    # -- answering ----------------------------------------------------------------------
    def _answer(self, frame: bytes) -> None:
        self._out += frame
        self._flush()

    def _flush(self) -> None:
        """Send what the socket takes of the answers; watch it for room if some is left."""
        try:
            while self._out:
                n = self.conn.send(self._out)
                del self._out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._ended(f"answering: {exc}", clean=False)
            return
        if self._out:
            self._watch(writing=True)
        elif self._closing:
            self.close()
        else:
            self._watch(writing=False)

    def _watch(self, *, writing: bool) -> None:
        if writing == self._writing or self._closed:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.t.selector.modify(self.conn, events, self)
            self._writing = writing

    # -- ends ---------------------------------------------------------------------------
    def _ended(self, why: str, *, clean: bool) -> None:
        """The connection ended (``why``): a transfer cut in the middle fails the link."""
        if self._closed:
            return
        if (self._in_transfer or self._mid_frame()) and self.link.live:
            self._link_failed(None, st.TCP_CONNECTION_LOST,
                              f"{why} in the middle of a transfer")
        elif not clean and not self.t.closed:
            log.info("TCP transport: inbound connection from %s ended: %s", self.peer, why)
        self.close()

    def _link_failed(self, transfer_id: int | None, status: str, detail: str) -> None:
        log.warning("TCP transport: link %d: %s: %s", self.link.id, status, detail)
        self.t.link_failed(status)
        self.t.emit(Event(EventKind.LINK_FAILED, self.link.id, transfer_id, False, status, detail))
