"""TCP transport: the same interface for hosts without RDMA.

Each side listens on one port. A link's outbound connection carries its writes:
the sender streams each block's bytes straight from local memory in WRITE frames
(header with destination address and length), then an END frame per transfer.
The receiver checks every block against its remote-writable regions before it
lands the bytes, straight from the socket into the destination, and answers END
with ACK (after emitting the notification) or NAK (a block was refused). The
writer's COMPLETED event follows ACK/NAK, so it means what an RDMA completion means.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence

from kvbeam.errors import TransportError
from kvbeam.transport import status as st
from kvbeam.transport import tcp_wire as wire
from kvbeam.transport.base import Access, Event, EventKind, Link, Registration, Transport
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import (
    EventQueue,
    Prepared,
    RegistrationBook,
    prepare,
    remote_table,
    wait_readable,
)
from kvbeam.transport.endpoint import Endpoint, Region
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.stats import TransferMeter, TransportStats

log = logging.getLogger(__name__)

_TICK_S = 0.25  # how often idle reader threads look at deadlines and the stop flag


class TcpTransport(Transport):
    """Listens on ``host:port`` (port 0: any free port) and serves links over TCP."""

    kind = "tcp"

    def __init__(self, host: str | None = None, port: int = 0,
                 options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()
        self.host = host or os.environ.get("KVBEAM_TCP_HOST", "127.0.0.1")
        self._listener = socket.create_server((self.host, port))
        self.port = int(self._listener.getsockname()[1])
        self._events = EventQueue()
        self._meter = TransferMeter()
        self._book = RegistrationBook()
        self._lock = threading.Lock()
        self._links: dict[int, TcpLink] = {}
        self._by_token: dict[str, TcpLink] = {}
        self._next_id = 1
        self._closed = threading.Event()
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

    def events(self, timeout: float | None = 0.0) -> list[Event]:
        """Queued events, waiting up to ``timeout`` for the first."""
        return self._events.drain(timeout)

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
        self._accepter.join(timeout=2 * _TICK_S + 1)
        for reg in self._book.all():
            reg.release()

    # -- internals used by links -------------------------------------------------
    def _emit(self, event: Event) -> None:
        self._meter.on_event(event)
        self._events.put(event)

    def _forget(self, link: TcpLink) -> None:
        with self._lock:
            self._links.pop(link.id, None)
            self._by_token.pop(link.token, None)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                if not wait_readable([self._listener.fileno()], _TICK_S):
                    continue
                conn, peer = self._listener.accept()
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                log.exception("TCP transport: accept failed")
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name=f"kvbeam-tcp-recv-{peer}").start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        """Receive side of one inbound connection: HELLO, then WRITE*/END frames."""
        conn.settimeout(self.options.op_timeout_s)
        try:
            hello = wire.recv_header(conn)
            if hello is None or hello[0] != wire.HELLO or hello[4] > 256:
                log.warning("TCP transport: %s sent no HELLO; dropping the connection", peer)
                return
            token = wire.recv_bytes(conn, hello[4]).decode("ascii", "replace")
            with self._lock:
                link = self._by_token.get(token)
            if link is None:
                log.warning("TCP transport: %s named no link of ours; dropping it", peer)
                return
            link._inbound.add(conn)
            try:
                _Receiver(self, link, conn).run()
            finally:
                link._inbound.discard(conn)
        except (OSError, ConnectionError) as exc:
            if not self._closed.is_set():
                log.info("TCP transport: inbound connection from %s ended: %s", peer, exc)
        finally:
            conn.close()


class _Receiver:
    """Lands WRITE frames of one inbound connection and answers each END."""

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
                if in_transfer and self.link._live():
                    self._link_failed(None, st.TCP_CONNECTION_LOST,
                                      f"{eof_reason} in the middle of a transfer")
                return
            kind, flags, transfer_id, addr, length = header
            if kind == wire.WRITE:
                in_transfer = True
                # The table is read per block: registrations may change between transfers.
                if refused is None and self.t._book.writable.contains(addr, length):
                    wire.recv_into(self.conn, wire.view(addr, length))
                    landed += length
                    continue
                if refused is None:
                    refused = (f"block at {addr:#x} length {length} is outside every "
                               f"remote-writable region of the receiver")
                wire.discard(self.conn, length)
            elif kind == wire.END:
                in_transfer = False
                self.t._meter.received(landed)
                landed = 0
                if refused is not None:
                    detail = refused.encode()
                    wire.send_all(self.conn, wire.frame(wire.NAK, transfer_id, 0, len(detail))
                                  + detail)
                    self._link_failed(transfer_id, st.TCP_REMOTE_ACCESS_ERR, refused)
                    return
                if flags & wire.FLAG_NOTIFY:
                    self.t._emit(Event(EventKind.NOTIFIED, self.link.id, transfer_id))
                wire.send_all(self.conn, wire.frame(wire.ACK, transfer_id))
            else:
                log.warning("TCP transport: unknown frame kind %d; dropping the connection", kind)
                return

    def _link_failed(self, transfer_id: int | None, status: str, detail: str) -> None:
        log.warning("TCP transport: link %d: %s: %s", self.link.id, status, detail)
        self.t._meter.link_failed(status)
        self.t._emit(Event(EventKind.LINK_FAILED, self.link.id, transfer_id, False, status, detail))


class TcpLink(Link):
    """One peer over TCP: an outbound connection for our writes, with a sender thread
    that streams queued transfers and a reader thread that turns ACK/NAK into events."""

    def __init__(self, transport: TcpTransport, link_id: int, token: str) -> None:
        self.id = link_id
        self.token = token
        self._t = transport
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._peer: RegionTable | None = None
        self._queue: queue.SimpleQueue[Prepared | None] = queue.SimpleQueue()
        self._inflight: deque[int] = deque()  # END sent, ACK awaited, in order
        self._sending: int | None = None  # the transfer the sender thread is streaming
        self._progress = time.monotonic()
        self._failure: tuple[str, str] | None = None
        self._released = False
        self._threads: list[threading.Thread] = []
        self._inbound: set[socket.socket] = set()
        self._check_remote = True  # tests turn this off to make the receiver refuse a block

    @property
    def endpoint(self) -> Endpoint:
        """Our listening address, the token naming this link, our remote-writable regions."""
        return Endpoint(kind="tcp", regions=self._t._book.remote_regions(),
                        address=f"{self._t.host}:{self._t.port}", extra={"token": self.token})

    def connect(self, peer: Endpoint) -> None:
        """Open the outbound connection to the peer's listener and name its link."""
        if peer.kind != "tcp":
            raise TransportError(f"TCP link cannot connect to a {peer.kind!r} endpoint")
        token = peer.extra.get("token", "")
        host, _, port = peer.address.rpartition(":")
        if not token or not host or not port.isdigit():
            raise TransportError(f"TCP endpoint lacks address or token: {peer.address!r}")
        with self._lock:
            if self._sock is not None or self._released:
                raise TransportError(f"link {self.id} is already connected or released")
            self._peer = remote_table(peer.regions)
            try:
                sock = socket.create_connection((host, int(port)), self._t.options.op_timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                wire.send_all(sock, wire.frame(wire.HELLO, length=len(token)) + token.encode())
            except OSError as exc:
                raise TransportError(f"cannot connect to TCP peer {peer.address}: {exc}",
                                     st.TCP_CONNECTION_LOST) from exc
            self._sock = sock
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
                           self._t._book.local, peer, self._check_remote)
        with self._lock:  # checked again under the lock that _fail drains the queue under
            self._usable_peer()
            # Counted before queueing: the ACK (and its event) may follow at once.
            self._t._meter.submitted(self.id, transfer_id, blocks.total_bytes, len(blocks))
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
        self._t._forget(self)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2 * _TICK_S + 1)

    # -- internals -------------------------------------------------------------------
    def _live(self) -> bool:
        return not self._released and self._failure is None

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
        self._t._meter.link_failed(status)
        # A peer that goes away between transfers is routine (it closed or restarted).
        log.log(logging.WARNING if dropped else logging.INFO, "TCP link %d failed: %s: %s",
                self.id, status, detail)
        self._finish(dropped, status, detail, quiet=False)

    def _finish(self, dropped: list[int], status: str, detail: str, quiet: bool) -> None:
        if self._sock is not None:
            _shutdown(self._sock)
        for transfer_id in dropped:
            self._t._emit(Event(EventKind.COMPLETED, self.id, transfer_id, False, status, detail))
        if not dropped and not quiet:
            self._t._emit(Event(EventKind.LINK_FAILED, self.id, None, False, status, detail))

    def _send_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._lock:
                # From here until END is sent the transfer is ours; a failure or release
                # meanwhile reports it (see _drain_locked), so it never goes missing.
                if not self._live():
                    self._finish([item.transfer_id], *(self._failure or (st.CANCELLED, "")),
                                 quiet=True)
                    return
                self._sending = item.transfer_id
            try:
                for src, dst, length in zip(item.src.tolist(), item.dst.tolist(),
                                            item.lengths.tolist(), strict=True):
                    wire.send_write(sock, src, dst, length)
                    self._progress = time.monotonic()
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

    def _ack_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        timeout = self._t.options.op_timeout_s
        while self._live():
            try:
                if not wait_readable([sock.fileno()], _TICK_S):
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
                    self._t._emit(Event(EventKind.COMPLETED, self.id, transfer_id, True, st.OK))
                elif kind == wire.NAK:
                    # The refused transfer heads _inflight; it and all after it fail.
                    text = wire.recv_bytes(sock, length).decode("utf-8", "replace")
                    self._fail(st.TCP_REMOTE_ACCESS_ERR, text)
                    return
                else:
                    raise ConnectionError(f"unexpected frame kind {kind} from the receiver")
            except (OSError, ConnectionError, ValueError) as exc:
                if self._live():
                    self._fail(st.TCP_CONNECTION_LOST, f"reading from the peer: {exc}")
                return


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
