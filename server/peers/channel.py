"""The peer channel's sockets: one long-lived TCP connection per daemon pair.

Every per-request message between the two daemons goes here, and nowhere else:
decode's Offer and Abort to prefill, prefill's BeginWrite and Abort to decode, and the
heartbeats between them; the frames are :mod:`kvbeam.proto.peer_frames`'
(docs/protocol.md, "The peer channel"). The handshake, health, admin, decode's ask to
connect and the scheduler API stay gRPC.

**Who opens it.** Prefill, right after its handshake with decode succeeds: prefill is
the handshake's client (it dials decode to send a request), and decode's handshake
reply carries the channel's address and a fresh random token naming the pair
(:data:`CHANNEL_ADDRESS_KEY`, :data:`CHANNEL_TOKEN_KEY` in the endpoint's extras). The
token is how the TCP data plane authenticates its connections (its HELLO carries the
link's token): it travels only in the handshake, which the control plane's mTLS or
shared token protects, and binds the connection to the verified pair. A malformed
frame closes the channel with a log line naming the peer and what was wrong; nothing
here raises into the daemon.

**Threads.** :class:`PeerChannels` is a source of the daemon's loop
(:mod:`kvbeam.loop`), the one thread that reads every channel, accepts decode's
inbound ones, sends heartbeats, finds silent peers and expired calls. A writer
appends its frame to the channel's bounded outbound buffer and tries one non-blocking
``send`` under the channel's write lock (a leaf, never held across a blocking call);
what the kernel does not take, the daemon's loop flushes.
A peer that stops reading until the buffer passes :data:`MAX_OUTBOUND` is failed.

**Time.** Heartbeats, silence, call deadlines and the HELLO deadline are read on the
hub's ``clock`` (the daemon's; a test passes one it moves). The blocking waits on a
caller's thread (``connect``'s socket timeout, ``call``'s backstop) are the kernel's
and the futures' own, in real seconds.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from kvbeam.errors import FrameError
from kvbeam.errors import PeerChannelError as ChannelError
from kvbeam.loop import DaemonLoop, SourceSelector, join_loop, leave_loop
from kvbeam.proto.peer_frames import (
    BYE,
    HEADER,
    HELLO,
    MAX_HELLO_BYTES,
    PING,
    PONG,
    REPLY,
    REQUESTS_TO,
    WELCOME,
    Hello,
    Reply,
    decode_hello,
    decode_reply,
    encode_hello,
    encode_reply,
    encode_request,
    frame,
    kind_name,
    split_frames,
)
from kvbeam.proto.peer_frames import bye as bye_frame

log = logging.getLogger(__name__)

#: Endpoint extras in decode's handshake reply: where its channel listens, and the
#: pair's token (a secret: it is only ever sent inside the authenticated handshake).
CHANNEL_ADDRESS_KEY = "kvbeam.peer_channel"
CHANNEL_TOKEN_KEY = "kvbeam.peer_channel_token"

#: Bytes a channel may hold unsent before its peer counts as stalled and is failed.
MAX_OUTBOUND = 64 << 20
#: How long an inbound connection has to send its HELLO (prefill sends it at once).
HELLO_TIMEOUT_S = 5.0
#: Inbound connections without a HELLO held at once; over it the oldest is dropped.
MAX_UNAUTHENTICATED = 64
#: How often call deadlines, heartbeats and silence are checked, s (the loop's timer).
TICK_S = 0.05
_READ = 256 << 10


def new_token() -> str:
    """A fresh random token naming one pair's channel."""
    return secrets.token_hex(16)


class _Call:
    __slots__ = ("deadline", "future", "what")

    def __init__(self, what: str, deadline: float) -> None:
        self.what = what
        self.deadline = deadline
        self.future: Future[Reply] = Future()


#: Handles a request that arrived: (channel, kind, correlation id, payload).
RequestHandler = Callable[["PeerChannel", int, int, bytes], None]


class PeerChannel:
    """One established channel to one verified peer (see the module docstring).

    ``bound`` is what the daemon bound it to (its peer connection). Calls and frames
    may come from any thread; only the daemon's loop reads the socket.
    """

    def __init__(self, hub: PeerChannels, sock: socket.socket, peer: str) -> None:
        self.hub = hub
        self.sock = sock
        #: The peer as messages name it ("decode 3f2a at 10.0.0.2:7000").
        self.peer = peer
        self.bound: Any = None
        self.last_heard = hub.clock()
        self.closed = False
        self.close_reason = ""
        #: The close was orderly (a BYE either way): the peer lives, its link was replaced.
        self.orderly = False
        self._wlock = threading.Lock()  # leaf: the outbound buffer; non-blocking send only
        self._out = bytearray()
        self._calls: dict[int, _Call] = {}
        self._next = 1
        self._inbox = bytearray()  # loop thread only
        self._missed_logged = 0  # loop thread only: the last count logged

    def __repr__(self) -> str:
        return f"PeerChannel({self.peer}{', closed' if self.closed else ''})"

    def missed_heartbeats(self, now: float | None = None) -> int:
        """Heartbeats the peer has left unanswered in a row: the whole intervals it has
        been silent, less one (both sides ping every ``heartbeat_s`` and answer a ping at
        once, so a live peer is never silent for two; the RPC heartbeat's rule, which
        waits two intervals for an answer)."""
        silent = (self.hub.clock() if now is None else now) - self.last_heard
        return max(0, int(silent / self.hub.heartbeat_s) - 1)

    def note_silence(self, now: float) -> None:
        """Log each heartbeat newly missed and the peer's return (the loop thread's
        sweep), as the RPC heartbeat loop does."""
        if not self._missed_logged and (now - self.last_heard) / self.hub.heartbeat_s < 2.0:
            return  # the usual pass: none missed (missed_heartbeats' 0), none logged before
        missed = self.missed_heartbeats(now)
        if missed > self._missed_logged:
            log.warning("heartbeat %d on the peer channel to %s missed (silent %.1f s of "
                        "%.1f s allowed)", missed, self.peer, now - self.last_heard,
                        self.hub.silence_limit_s)
        elif missed == 0 and self._missed_logged:
            log.info("peer channel to %s: the peer answers again", self.peer)
        self._missed_logged = missed

    # ---- writing (any thread) ---------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Queue ``data`` (whole frames) and send what the socket takes now.

        Never blocks; a peer that stopped reading until :data:`MAX_OUTBOUND` bytes wait
        is failed (the channel closes, every call on it fails at once)."""
        overflow = False
        with self._wlock:
            if self.closed:
                return
            if len(self._out) + len(data) > MAX_OUTBOUND:
                overflow = True
            else:
                self._out += data
                left = self._flush_locked()
        if overflow:
            self.close(f"the peer stopped reading: {MAX_OUTBOUND} bytes wait to be sent")
            return
        if left:
            self.hub.want_write(self)

    def _flush_locked(self) -> int:
        """Send what the kernel takes without blocking; bytes still waiting."""
        while self._out:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.hub.close_later(self, f"send failed: {exc}")
                self._out.clear()
                break
            del self._out[:n]
        return len(self._out)

    def flush(self) -> int:
        """The loop thread's flush: bytes still waiting."""
        with self._wlock:
            return self._flush_locked()

    def start_call(self, kind: int, message: bytes, timeout_s: float) -> Future[Reply]:
        """Send a request; its future resolves with the REPLY or a ChannelError (a
        refusal, the channel closing, or ``timeout_s`` passing)."""
        with self._wlock:
            correlation = self._next
            self._next = self._next % 0xFFFFFFFF + 1
            call = _Call(kind_name(kind), self.hub.clock() + timeout_s)
            self._calls[correlation] = call
            closed = self.closed
        if closed:
            self._resolve(correlation, ChannelError(
                grpc.StatusCode.UNAVAILABLE, f"peer channel to {self.peer} closed: "
                                             f"{self.close_reason}"))
        else:
            self.send(encode_request(kind, correlation, message, timeout_s))
        return call.future

    def call(self, kind: int, message: bytes, timeout_s: float) -> Reply:
        """:meth:`start_call` and wait (bounded by ``timeout_s``; the hub expires it).

        Raises:
            ChannelError: refused, closed or timed out.
        """
        future = self.start_call(kind, message, timeout_s)
        try:
            return future.result(timeout_s + 1.0)
        except TimeoutError:  # the hub expires calls; this is only its backstop
            raise ChannelError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"{kind_name(kind)} on the peer channel to "
                               f"{self.peer}: no answer within {timeout_s:g} s") from None

    def reply(self, correlation: int, code: grpc.StatusCode, details: str = "",
              message: bytes = b"", in_flight: int = 0) -> None:
        """Answer a request that arrived."""
        self.send(encode_reply(correlation, code, details, message, in_flight))

    # ---- reading (the loop thread) ----------------------------------------------------
    def received(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """Whole frames in what arrived: (kind, correlation, payload) each.

        Raises:
            FrameError: a header announcing more than :data:`MAX_PAYLOAD`.
        """
        self.last_heard = self.hub.clock()
        self._inbox += data
        return split_frames(self._inbox)

    def answered(self, correlation: int, payload: bytes) -> None:
        """A REPLY arrived (raises FrameError when it is malformed)."""
        result = decode_reply(payload)
        self._resolve(correlation, result)

    def _resolve(self, correlation: int, result: Reply | ChannelError) -> None:
        with self._wlock:
            call = self._calls.pop(correlation, None)
        if call is None:
            return  # answered after its deadline: the caller has gone on
        if isinstance(result, ChannelError):
            call.future.set_exception(result)
        else:
            call.future.set_result(result)

    def expire(self, now: float) -> None:
        """Fail calls past their deadline."""
        if not self._calls:  # the usual pass (every pass sweeps): no lock, no scan
            return
        with self._wlock:
            late = [(c, call) for c, call in self._calls.items() if call.deadline < now]
        for correlation, call in late:
            self._resolve(correlation, ChannelError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{call.what} on the peer channel to {self.peer}: no answer in time"))

    def close(self, reason: str, *, bye: bool = False, orderly: bool = False) -> None:
        """Close the channel (idempotent): every call waiting on it fails now, and the
        hub reports the loss to the daemon (whose handler decides what it means).

        ``bye``: we close it on purpose (its connection was replaced or released): say
        so to the peer first (a BYE, best effort), so it does not take the peer for
        gone. ``orderly``: the peer said BYE."""
        with self._wlock:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            self.orderly = bye or orderly
            calls, self._calls = self._calls, {}
            if bye:
                self._out += bye_frame(reason)
                self._flush_locked()
            self._out.clear()
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(ChannelError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{call.what}: peer channel to {self.peer} closed: {reason}"))
        self.hub.closed(self, reason)


def _give_up(sock: socket.socket, why: str) -> None:
    """Close a channel we opened and gave up on before its WELCOME, saying BYE first
    (best effort): decode may have bound it already, and a BYE-less close would make
    it take us, alive and about to handshake again, for gone."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(bye_frame(f"prefill gave up on this channel: {why}"))
    sock.close()


class PeerChannels:
    """A daemon's peer channels, all served on the daemon's loop.

    Args:
        role: our role ("prefill" or "decode"): which requests we accept.
        on_request: handles a request frame (it answers with :meth:`PeerChannel.reply`).
        on_closed: a bound channel closed (reason given); the daemon fails its peer.
        on_hello: decode's check of a HELLO: the object to bind the channel to, or
            raises FrameError (the channel is closed, the reason logged).
        heartbeat_s: how often every channel is pinged.
        peer_timeout_s: how long a peer may leave our pings unanswered before it counts as
            lost: a channel is closed after ``heartbeat_s + peer_timeout_s`` of silence
            (:attr:`silence_limit_s`), since a live peer's next frame may come a whole
            interval after its last one.
        clock: the time source of heartbeats, silence and deadlines (seconds,
            monotonic): the daemon's; a test passes one it moves.
    """

    def __init__(self, role: str, on_request: RequestHandler,
                 on_closed: Callable[[PeerChannel, str], None], *,
                 on_hello: Callable[[PeerChannel, Hello], Any] | None = None,
                 heartbeat_s: float = 1.0, peer_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.role = role
        self.clock = clock
        self.requests = REQUESTS_TO[role]
        self.on_request = on_request
        self.on_closed = on_closed
        self.on_hello = on_hello
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        #: Silence after which a channel's peer is lost. Counted from the peer's last
        #: frame, so one heartbeat interval more than the timeout: with heartbeats far
        #: apart (``--heartbeat-s 3600``) an idle channel must not die of its own quiet.
        self.silence_limit_s = heartbeat_s + peer_timeout_s
        self.address = ""  # where we listen ("" : we do not)
        self._loop: DaemonLoop | None = None  # set by start()
        self._owns_loop = False
        self._sel: SourceSelector | None = None
        self._lock = threading.Lock()  # leaf: the queues below
        self._adds: list[PeerChannel] = []
        self._writes: set[PeerChannel] = set()
        self._to_close: list[tuple[PeerChannel, str]] = []
        self._channels: set[PeerChannel] = set()  # loop thread only
        self._pending: dict[socket.socket, tuple[float, str, bytearray]] = {}
        self._listener: socket.socket | None = None
        self._last_beat = 0.0
        #: When the loop next runs :meth:`_check_times` (the loop's time).
        self._next_check = 0.0

    # ---- lifecycle ----------------------------------------------------------------------
    def listen(self, host: str, port: int, advertise_host: str) -> str:
        """Bind the channel listener (decode); returns the address peers dial."""
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        bound = sock.getsockname()[1]
        adv = advertise_host.strip("[]")
        self.address = f"[{adv}]:{bound}" if ":" in adv else f"{adv}:{bound}"
        log.info("peer channel listening on %s:%d (advertised %s)", host, bound, self.address)
        return self.address

    def start(self, loop: DaemonLoop | None = None) -> None:
        """Serve the channels on ``loop`` (the daemon's), or on a loop of their own
        (a thread named ``kvbeam-peer-channel``) when none is given."""
        self._loop, self._owns_loop = join_loop(loop, "kvbeam-peer-channel", self._join_loop)
        self._wake()  # channels connected before the start

    def _join_loop(self, loop: DaemonLoop) -> None:
        """Become a source of ``loop`` and watch the listener (on the loop thread). The
        loop is ours before the listener is watched: a peer may connect in its next pass."""
        self._loop = loop
        self._sel = loop.add(self)
        if self._listener is not None:
            self._selector.register(self._listener, selectors.EVENT_READ, "listen")

    @property
    def _selector(self) -> SourceSelector:
        """Our view of the loop's selector (the loop thread's, once started)."""
        assert self._sel is not None, "PeerChannels.start() first"
        return self._sel

    def stop(self) -> None:
        """Close every channel and leave the loop (stopping it when it is our own)."""
        if self._loop is not None:
            leave_loop(self._loop, self, self._owns_loop)
        with self._lock:
            adds, self._adds = self._adds, []
        for channel in [*self._channels, *adds]:
            channel.close("this daemon stops")
            channel.sock.close()  # the thread that would close it has stopped
        for sock in list(self._pending):
            sock.close()
        if self._listener is not None:
            self._listener.close()

    # ---- opening (prefill, on the caller's thread) ----------------------------------------
    def connect(self, address: str, hello: Hello, peer: str, timeout_s: float) -> PeerChannel:
        """Dial ``address``, send the HELLO, wait for WELCOME; the established channel.

        Blocking (a TCP connect and one round trip, bounded by ``timeout_s``): call it
        where the handshake runs (the executor), never under a lock.

        Raises:
            OSError: unreachable, refused, closed or silent (the message says which).
        """
        host, _, port = address.rpartition(":")
        # Real seconds, not the hub's clock: the kernel times the socket's waits.
        deadline = time.monotonic() + timeout_s
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(encode_hello(hello))
            got = bytearray()
            while len(got) < HEADER.size:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(HEADER.size - len(got))
                if not chunk:
                    raise ConnectionError(f"peer channel to {peer} at {address} closed before "
                                          "its WELCOME: it refused our HELLO (see its log)")
                got += chunk
            kind, _, length = HEADER.unpack(got)
            if kind != WELCOME or length:
                raise ConnectionError(f"peer channel to {peer} at {address}: answered "
                                      f"{kind_name(kind)} to our HELLO, not WELCOME")
        except TimeoutError:
            _give_up(sock, f"no WELCOME within {timeout_s:g} s")
            raise TimeoutError(f"peer channel to {peer} at {address}: no WELCOME within "
                               f"{timeout_s:g} s") from None
        except BaseException as exc:
            _give_up(sock, f"opening the channel failed: {exc}")
            raise
        sock.setblocking(False)
        channel = PeerChannel(self, sock, peer)
        with self._lock:
            self._adds.append(channel)
        self._wake()
        return channel

    # ---- requests from other threads --------------------------------------------------------
    def want_write(self, channel: PeerChannel) -> None:
        """A channel has bytes the kernel did not take: the selector flushes them."""
        with self._lock:
            self._writes.add(channel)
        self._wake()

    def close_later(self, channel: PeerChannel, reason: str) -> None:
        """Close ``channel`` from the loop thread (a writer found its socket broken)."""
        with self._lock:
            self._to_close.append((channel, reason))
        self._wake()

    def closed(self, channel: PeerChannel, reason: str) -> None:
        """Called by :meth:`PeerChannel.close`: unregister it, tell the daemon."""
        with self._lock:
            self._to_close.append((channel, ""))  # the selector unregisters and closes it
        self._wake()
        log.log(logging.INFO if channel.orderly else logging.WARNING,
                "peer channel to %s closed: %s", channel.peer, reason)
        if channel.bound is not None:
            try:
                self.on_closed(channel, reason)
            except Exception:
                log.exception("handling the loss of the peer channel to %s failed",
                              channel.peer)

    def _wake(self) -> None:
        """Queued work for the loop (any thread): our tick takes it at once."""
        if self._loop is not None:
            self._loop.poke(self)

    # ---- on the loop (LoopSource) -----------------------------------------------------------
    def tick(self, now: float) -> float:
        """When poked: queued channels, writes and closes. Every ``TICK_S`` of the
        loop's time: heartbeats, silence, call deadlines, connections still without
        their HELLO (on our own clock, which tests move)."""
        if self._adds or self._writes or self._to_close:  # read unlocked: a later one pokes
            self._take_queued()
        if now >= self._next_check:
            self._next_check = now + TICK_S
            self._check_times(self.clock())
        return self._next_check

    def ready(self, data: Any, mask: int) -> None:
        """A socket we registered is ready: the listener, a connection that has not
        sent its HELLO (``("pending", sock)``), or a channel's."""
        if data == "listen":
            self._accept()
        elif isinstance(data, tuple):
            self._read_hello(data[1])
        elif isinstance(data, PeerChannel):
            if mask & selectors.EVENT_READ:
                self._read(data)
            if mask & selectors.EVENT_WRITE and not data.closed and not data.flush():
                self._selector.modify(data.sock, selectors.EVENT_READ, data)

    def _take_queued(self) -> None:
        """Channels to watch, writes to flush and channels to close, from any thread."""
        with self._lock:
            adds, self._adds = self._adds, []
            writes, self._writes = self._writes, set()
            closing, self._to_close = self._to_close, []
        for channel in adds:
            if channel.closed:
                continue
            self._channels.add(channel)
            self._selector.register(channel.sock, selectors.EVENT_READ, channel)
            channel.last_heard = self.clock()
        for channel in writes:
            if channel in self._channels and not channel.closed and channel.flush():
                self._selector.modify(channel.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                 channel)
        for channel, reason in closing:
            if reason:  # a writer found the socket broken: first read the peer's last words
                self._read_last_words(channel)
                channel.close(reason)
            if channel in self._channels:
                self._channels.discard(channel)
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(channel.sock)
            channel.sock.close()

    def _check_times(self, now: float) -> None:
        """Heartbeats, silence, call deadlines and HELLOs not sent in time, at ``now``
        (our clock)."""
        beat = now - self._last_beat >= self.heartbeat_s
        if beat:
            self._last_beat = now
        for channel in list(self._channels):
            channel.expire(now)
            channel.note_silence(now)
            silent = now - channel.last_heard
            if silent >= self.silence_limit_s:
                channel.close(f"peer stopped answering heartbeats on the peer channel "
                              f"(silent {silent:.1f} s, {self.silence_limit_s:g} s allowed)")
            elif beat:
                channel.send(frame(PING, 0))
        for sock, (deadline, who, _) in list(self._pending.items()):
            if now > deadline:
                self._drop_pending(sock, logging.WARNING,
                                   f"sent no HELLO within {HELLO_TIMEOUT_S:g} s", who)

    def _read_last_words(self, channel: PeerChannel) -> None:
        """Read what a peer sent before its socket broke under a writer (the kernel keeps
        it readable after a reset): a BYE there makes the close orderly, and REPLYs
        there answer their calls. A peer that said BYE and closed while our frame was
        on its way resets the connection, and without this the writer's error would
        take a live peer, whose link was only replaced, for gone. Requests there are
        not served: no answer could be sent."""
        while not channel.closed:
            try:
                data = channel.sock.recv(_READ)
            except OSError:  # nothing more (BlockingIOError) or the reset itself
                return
            if not data:
                return
            try:
                for kind, correlation, payload in channel.received(data):
                    if kind == BYE:
                        self._frame(channel, kind, correlation, payload)
                        return
                    if kind == REPLY:
                        channel.answered(correlation, payload)
            except FrameError:
                return

    def _read(self, channel: PeerChannel) -> None:
        try:
            data = channel.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            channel.close(f"receive failed: {exc}")
            return
        if not data:
            channel.close("the peer closed the connection")
            return
        try:
            frames = channel.received(data)
            for kind, correlation, payload in frames:
                self._frame(channel, kind, correlation, payload)
        except FrameError as exc:
            log.error("peer channel to %s: bad frame: %s; closing the channel", channel.peer,
                      exc)
            channel.close(f"bad frame: {exc}")

    def _frame(self, channel: PeerChannel, kind: int, correlation: int,
               payload: bytes) -> None:
        if kind == PING:
            channel.send(frame(PONG, correlation))
        elif kind == PONG:
            pass  # last_heard is updated by every frame
        elif kind == BYE:
            channel.close(f"the peer closed it: {payload.decode('utf-8', 'replace')}",
                          orderly=True)
        elif kind == REPLY:
            channel.answered(correlation, payload)
        elif kind in self.requests:
            self.on_request(channel, kind, correlation, payload)
        else:
            raise FrameError("kind", f"{kind_name(kind)} is not a frame a "
                                     f"{self.role} daemon accepts on an established channel")

    # ---- inbound connections (decode) ----------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("peer channel: accept failed: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._pending) >= MAX_UNAUTHENTICATED:
                oldest = min(self._pending, key=lambda s: self._pending[s][0])
                self._drop_pending(oldest, logging.WARNING,
                                   f"dropped: {MAX_UNAUTHENTICATED} connections wait for "
                                   "their HELLO", self._pending[oldest][1])
            who = f"{addr[0]}:{addr[1]}"
            self._pending[sock] = (self.clock() + HELLO_TIMEOUT_S, who, bytearray())
            self._selector.register(sock, selectors.EVENT_READ, ("pending", sock))

    def _drop_pending(self, sock: socket.socket, level: int, why: str, who: str) -> None:
        self._pending.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()
        log.log(level, "peer channel from %s refused: %s", who, why)

    def _read_hello(self, sock: socket.socket) -> None:
        _deadline, who, buf = self._pending[sock]
        try:
            data = sock.recv(HEADER.size + MAX_HELLO_BYTES - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop_pending(sock, logging.INFO, f"failed before its HELLO: {exc}", who)
            return
        if not data:
            self._drop_pending(sock, logging.INFO, "closed before its HELLO", who)
            return
        buf += data
        if len(buf) < HEADER.size:
            return
        kind, _, length = HEADER.unpack_from(buf)
        if kind != HELLO or length > MAX_HELLO_BYTES:
            self._drop_pending(sock, logging.WARNING,
                               f"its first frame is {kind_name(kind)} of {length} "
                               "bytes, not a HELLO", who)
            return
        if len(buf) < HEADER.size + length:
            return
        if len(buf) > HEADER.size + length:
            after = HEADER.size + length
            if len(buf) >= after + HEADER.size and buf[after] == BYE:  # it timed out waiting
                self._drop_pending(sock, logging.INFO, "it gave up before our WELCOME", who)
            else:
                self._drop_pending(sock, logging.WARNING, "it sent frames before its WELCOME",
                                   who)
            return
        self._pending.pop(sock)
        self._selector.unregister(sock)
        channel = PeerChannel(self, sock, who)
        try:
            hello = decode_hello(bytes(buf[HEADER.size:]))
            if self.on_hello is None:
                raise FrameError("hello", "this daemon accepts no peer channels")
            channel.bound = self.on_hello(channel, hello)
        except FrameError as exc:
            sock.close()
            log.warning("peer channel from %s refused: %s", who, exc)
            return
        except Exception:
            sock.close()
            log.exception("peer channel from %s: checking its HELLO failed", who)
            return
        self._channels.add(channel)
        self._selector.register(sock, selectors.EVENT_READ, channel)
        channel.send(frame(WELCOME, 0))
        log.info("peer channel from %s bound", channel.peer)
