"""What both daemons serve alike: Status, WatchStatus, Heartbeat, the peer channel's
requests, and the background loops.

:class:`DaemonServicer` is the adapter around a role's core (:mod:`kvbeam.server.core`)
for gRPC and for the peer channel: it decodes requests, calls the core, encodes the
answer and maps the core's errors to status codes (:func:`~kvbeam.rpc_errors.handled`
for an RPC, :func:`~kvbeam.rpc_errors.refusal` for a channel request). It owns the
driver's one bounded executor (:attr:`DaemonServicer.io`), on which the core runs
every blocking step, and the loops the runtime runs in threads: transport events and
deadline sweeps, each of which hands its events to the core.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from kvbeam.errors import FrameError, UnknownRequest
from kvbeam.logs import fields
from kvbeam.loop import DaemonLoop
from kvbeam.pools import digest, plan
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.spec import PoolSpec
from kvbeam.proto import engine_frames
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import ONE_WAY, decode_request, kind_name
from kvbeam.proto.side import ROLE_TO_PROTO, Role
from kvbeam.proto.transfer_codec import status_to_proto
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.rpc_errors import code_for, handled, refusal
from kvbeam.server.api.servicer import ControlServicer
from kvbeam.server.core import decode_pages
from kvbeam.server.core.prefill_driver import ABORT_WAITERS
from kvbeam.server.executor import LoggingExecutor
from kvbeam.server.peers.channel import PeerChannel, PeerChannels
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.lifecycle import follow
from kvbeam.server.state.peers import PeerConn, lost_peer
from kvbeam.states import TransferFacts, TransferStatus
from kvbeam.threads import name_os_thread
from kvbeam.transport import core as transport_core
from kvbeam.transport.base import Event

if TYPE_CHECKING:
    from kvbeam.server.runtime import Runtime

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest a WatchStatus stream stays open, seconds (a client re-opens it).
WATCH_LIMIT_S = 600.0
#: The same while more than half of the server's handler threads hold streams.
SHORT_WATCH_S = 0.5
#: Threads of the driver's executor: handshakes, digests, peer calls, link releases.
IO_WORKERS = 8
#: Threads that answer the peer channel's requests that may wait (an Abort drains): more
#: than the Aborts that may wait at once, so the other Aborts are answered at once.
PEER_WORKERS = ABORT_WAITERS + 2

#: Answers a peer channel request: (the channel it came on, its message, the caller's
#: deadline in s) -> (the answer, writes of the request still in flight).
ChannelHandler = Callable[[PeerChannel, Any, float], tuple[ProtoMessage, int]]


class RoleCore(Protocol):
    """What the adapter and the loops call on a role's core."""

    def on_event(self, event: Event) -> None:
        """A transport event."""

    def on_deadline(self, status: TransferStatus) -> None:
        """A transfer failed its state's deadline (already FAILED in the table)."""

    def on_peer_lost(self, conn: PeerConn, detail: str, *, gone: bool = True) -> None:
        """A peer stopped answering or its link broke."""

    def periodic(self) -> None:
        """Work each sweep (pruning, leases)."""

    def shutdown(self) -> None:
        """Fail every live transfer with reason shutdown."""

    def slot_of(self, request_id: str) -> int:
        """The request slot a transfer uses, -1 if none."""

    def facts_of(self, request_id: str) -> TransferFacts:
        """What a transfer moves (bytes, lists, verification), kept after it ended."""

    def reply_view(self, request_id: str) -> tuple[int, TransferFacts]:
        """Its slot and what it moves, for a status reply (one call into the core)."""

    def on_loop(self, call: Callable[[], T]) -> T:
        """Run ``call`` on the daemon's loop (the table's and the core's reads)."""

    def use_pools(self, spec: PoolSpec, layout: SideLayout, pools: AllocatedSide) -> None:
        """Work in these pools from now on (the own ones at start, or an engine's)."""

    def drop_pools(self, detail: str) -> None:
        """The engine's memory goes: fail every live request, release every link."""


class DaemonServicer(ControlServicer):
    """Shared RPCs and loops of the prefill and decode daemons."""

    core: RoleCore

    def __init__(self, runtime: Runtime, workers: int = IO_WORKERS) -> None:
        super().__init__(runtime.local, peers=runtime.peers)
        self.rt = runtime
        self.table = runtime.table
        #: The driver's one bounded executor: every blocking step of the core runs here.
        self.io = LoggingExecutor(max_workers=workers, thread_name_prefix="kvbeam-io",
                                  initializer=name_os_thread)
        #: The integrity digests' threads (--digest-threads), shared by every request.
        self.digest_pool = DigestPool(runtime.settings.digest_threads)
        if runtime.settings.integrity:
            # Without the compiled helper digests are correct, only slower: say so once.
            log.log(logging.INFO if digest.COMPILED else logging.WARNING,
                    "integrity digests: %s; %d digest thread(s)", digest.digester(),
                    runtime.settings.digest_threads)
        # The same for the planner: the Python path gives the same blocks, slower.
        log.log(logging.INFO if plan.COMPILED else logging.WARNING, "transfer plans: %s",
                plan.planner())
        log.log(logging.INFO if transport_core.COMPILED else logging.WARNING,
                "write preparation: %s", transport_core.preparer())
        if runtime.role is Role.DECODE:
            log.log(logging.INFO if decode_pages.COMPILED else logging.WARNING,
                    "claims on decode's items: %s", decode_pages.claims())
        log.log(logging.INFO if engine_frames.COMPILED else logging.WARNING,
                "index lists on the wire: %s", engine_frames.codec())
        self._watch_lock = threading.Lock()
        self._watchers = 0  # open WatchStatus streams
        #: Answers the channel's requests that may wait (Abort); the others are
        #: answered on the daemon's loop (core bookkeeping only, no I/O).
        self.peer_io = LoggingExecutor(max_workers=PEER_WORKERS,
                                          thread_name_prefix="kvbeam-peer",
                                          initializer=name_os_thread)
        settings = runtime.settings
        #: The peer channels: one per verified peer, all on the daemon's loop.
        self.channels = PeerChannels(
            runtime.role.value, self._channel_request, self._channel_closed,
            on_hello=self.channel_hello, heartbeat_s=settings.heartbeat_s,
            peer_timeout_s=settings.peer_timeout_s, clock=runtime.clock)
        #: Per channel request kind: (handler, request message, answered inline).
        self.channel_handlers: dict[int, tuple[ChannelHandler, type[ProtoMessage], bool]] = {}
        #: Per one-way frame kind (``ONE_WAY``): (handler, message); run on the channel's
        #: thread, no reply (the handler sends what it has to say).
        self.channel_notices: dict[int, tuple[Callable[[PeerChannel, Any], None],
                                              type[ProtoMessage]]] = {}

    # ---- hooks: the core decides ------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """A transport event (COMPLETED on prefill, NOTIFIED on decode, LINK_FAILED)."""
        self.core.on_event(event)

    def on_expired(self, status: TransferStatus) -> None:
        """A transfer failed its state's deadline (already FAILED in the table)."""
        self.core.on_deadline(status)

    def peer_lost(self, conn: PeerConn, detail: str, *, gone: bool = True) -> None:
        """A peer stopped answering or its link broke: fail its transfers, free everything."""
        self.core.on_peer_lost(conn, detail, gone=gone)

    def shutdown(self) -> None:
        """Fail every live transfer with reason shutdown; stop the executor."""
        try:
            self.core.shutdown()
        finally:
            self.channels.stop()
            self.io.shutdown(wait=False, cancel_futures=True)
            self.peer_io.shutdown(wait=False, cancel_futures=True)
            self.digest_pool.close()

    # ---- the peer channel --------------------------------------------------------------
    def start_channels(self, loop: DaemonLoop) -> None:
        """Serve the peer channels on the daemon's loop; decode listens (prefill dials it) on the
        control host (``--peer-port``, default any), advertised at the control
        address's host in every handshake reply."""
        if self.rt.role is Role.DECODE:
            host = self.rt.settings.listen.rpartition(":")[0] or "0.0.0.0"
            advertised = self.rt.local.control_address.rpartition(":")[0] or host
            self.channels.listen(host, self.rt.settings.peer_port, advertised)
        self.channels.start(loop)

    def channel_hello(self, channel: PeerChannel, hello: Any) -> PeerConn:
        """Check an inbound channel's HELLO; the connection to bind it to (decode's).

        Raises FrameError (the channel is refused): prefill opens channels."""
        raise FrameError("hello", f"a {self.rt.role.value} daemon accepts no peer channel")

    def _channel_request(self, channel: PeerChannel, kind: int, correlation: int,
                         payload: bytes) -> None:
        """A request on a channel: decode its message and answer it with its handler, on
        the daemon's loop or, if it may wait, on ``peer_io``.

        Raises FrameError (the channel closes) when the frame cannot be decoded."""
        if kind in ONE_WAY:
            self._channel_notice(channel, kind, payload)
            return
        handler, message_type, inline = self.channel_handlers[kind]
        timeout_s, raw = decode_request(payload)
        try:
            request = message_type.FromString(raw)
        except DecodeError as exc:
            raise FrameError(kind_name(kind), f"not a {message_type.__name__}: {exc}") from None
        claimed = getattr(request, "instance_id", "")
        bound = channel.bound
        if claimed and claimed != bound.instance_id:
            channel.reply(correlation, grpc.StatusCode.PERMISSION_DENIED,
                          f"PermissionDenied: the peer channel is bound to instance "
                          f"{bound.instance_id}, the request names {claimed!r}")
            return
        if inline:
            self._answer(handler, channel, kind, request, timeout_s, correlation)
        else:
            self.peer_io.submit(self._answer, handler, channel, kind, request, timeout_s,
                                correlation)

    def _channel_notice(self, channel: PeerChannel, kind: int, payload: bytes) -> None:
        """A one-way frame: its message, to its handler on this thread (no reply).

        Raises FrameError (the channel closes) when it is not one this side takes or
        cannot be decoded."""
        entry = self.channel_notices.get(kind)
        if entry is None:
            raise FrameError("kind", f"{kind_name(kind)} is not a frame a "
                                     f"{self.rt.role.value} daemon takes")
        handler, message_type = entry
        try:
            message = message_type.FromString(payload)
        except DecodeError as exc:
            raise FrameError(kind_name(kind), f"not a {message_type.__name__}: {exc}") from None
        try:
            handler(channel, message)
        except Exception:  # handlers log and answer their own refusals: this is our bug
            log.exception("handling %s from %s failed", kind_name(kind), channel.peer)

    def _answer(self, handler: ChannelHandler, channel: PeerChannel, kind: int,
                request: ProtoMessage, timeout_s: float, correlation: int) -> None:
        """Answer one request: its handler's answer, or the status of its refusal."""
        try:
            reply, in_flight = handler(channel, request, timeout_s)
        except Exception as exc:  # every failure becomes a status; the channel stays up
            code, details = self.channel_refusal(exc, kind_name(kind), channel,
                                                 getattr(request, "request_id", ""))
            channel.reply(correlation, code, details)
            return
        channel.reply(correlation, grpc.StatusCode.OK, message=reply.SerializeToString(),
                      in_flight=in_flight)

    def channel_refusal(self, exc: BaseException, what: str, channel: PeerChannel,
                        request_id: str) -> tuple[grpc.StatusCode, str]:
        """The status that answers a channel request or notice refused with ``exc``
        (logged, and counted as an RPC refusal is)."""
        self.on_refused(what, code_for(exc))
        return refusal(exc, what, fields(request_id or None, channel.peer))

    def _channel_closed(self, channel: PeerChannel, reason: str) -> None:
        """A bound channel closed. Closed without a BYE (the peer's process went, it fell
        silent, it sent a bad frame): its peer is lost, its requests fail at once. A BYE
        (the peer released or replaced that connection: its link failed, an engine
        detached) only retires the channel: each side handles its own link as before
        (its transport reports the failure): prefill's next step on that connection drops
        it and handshakes again, which opens a new channel; decode makes no offer on it;
        a connection left without an open channel is dropped by the sweep after the
        peer timeout (:meth:`sweep`)."""
        conn = lost_peer(channel, self.rt.peers)
        if conn is None:
            return
        self.io.submit(self.peer_lost, conn, f"peer channel to {channel.peer} lost: {reason}",
                       gone=True)

    def slot_of(self, request_id: str) -> int:
        """The request slot a transfer uses, -1 if none (for status replies)."""
        return self.core.slot_of(request_id)

    def periodic(self) -> None:
        """Role-specific work each sweep (pruning, decode's hand-off leases)."""
        self.core.periodic()

    def on_refused(self, method: str, code: grpc.StatusCode) -> None:
        """An RPC was answered with an error status (called by ``handled``): count it."""
        self.rt.metrics.rpc_refusals.labels(method, code.name).inc()

    # ---- shared RPCs ----------------------------------------------------------
    def Handshake(self, request: pb.HandshakeRequest,
                  context: grpc.ServicerContext) -> pb.HandshakeResponse:
        """The handshake (see ControlServicer), timed and counted as the server side.

        Refused FAILED_PRECONDITION while an engine daemon has no memory attached: our
        side has no layout or regions to offer yet.
        """
        if not self.rt.attached:
            self.on_refused("Handshake", grpc.StatusCode.FAILED_PRECONDITION)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"NoEngineAttached: {self.rt.no_engine}")
        with self.rt.metrics.handshake("server"):
            return super().Handshake(request, context)

    def _status(self, snap: TransferStatus) -> pb.TransferStatus:
        """``snap`` as a reply, with its slot, what it moves and its timeline: read on
        the loop (the table's and the core's), in one call handed to it."""
        rid = snap.request_id

        def reply() -> pb.TransferStatus:
            slot, facts = self.core.reply_view(rid)
            return status_to_proto(snap, slot=slot, facts=facts,
                                   timeline=self.table.timeline(rid))
        return self.core.on_loop(reply)

    def _require_status(self, request_id: str) -> TransferStatus:
        snap = self.table.status(request_id, self.rt.clock())  # its age as of now
        if snap is None:
            raise UnknownRequest(f"unknown request id {request_id!r} on this "
                                 f"{self.rt.role.value} daemon")
        return snap

    @handled
    def Status(self, request: pb.StatusRequest,
               context: grpc.ServicerContext) -> pb.TransferStatus:
        """The current state of a transfer."""
        return self._status(self._require_status(request.request_id))

    def WatchStatus(self, request: pb.StatusRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.TransferStatus]:
        """Stream every state change until the transfer ends (or the stream's limit)."""
        rid = request.request_id
        watch = self.core.on_loop(lambda: self.table.subscribe(rid))
        if watch is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"UnknownRequest: unknown request id {rid!r}")
        # Each open stream holds one of the server's handler threads. Past half of them,
        # streams end after SHORT_WATCH_S (clients re-open them) so the peer's BeginWrite,
        # Abort and Heartbeat always find a thread: otherwise a scheduler waiting on many
        # requests starves them, and the peer is declared lost.
        with self._watch_lock:
            self._watchers += 1
            crowded = self._watchers > self.rt.options.max_workers // 2
        try:
            limit = SHORT_WATCH_S if crowded else WATCH_LIMIT_S
            remaining = context.time_remaining()
            if remaining is not None:
                limit = min(limit, remaining)
            for snap in follow(watch, limit, self.rt.clock):
                if not context.is_active():
                    return
                yield self._status(snap)
        finally:
            with self._watch_lock:
                self._watchers -= 1
            with contextlib.suppress(TimeoutError):  # a stalled loop: it ends with the request
                self.core.on_loop(lambda: self.table.unsubscribe(rid, watch))

    @handled
    def Heartbeat(self, request: pb.HeartbeatRequest,
                  context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        """Liveness, identity and capacity for schedulers (the daemons' own heartbeats
        are the peer channel's): a scheduler picks the decode with the most free slots
        from it."""
        held, total = self.rt.slot_usage()
        return pb.HeartbeatResponse(instance_id=self.local.instance_id,
                                    role=ROLE_TO_PROTO[self.rt.role],
                                    protocol_version=PROTOCOL_VERSION,
                                    slots=total, slots_held=held,
                                    live_transfers=self.table.live_count())

    def on_peer_restarted(self, old: VerifiedPeer, new: VerifiedPeer) -> None:
        """A peer came back with a new instance id: its old connection is dead."""
        conn = self.rt.peers.get(old.instance_id)
        if conn is not None:
            self.peer_lost(conn, f"peer restarted (instance {old.instance_id} -> "
                                 f"{new.instance_id})")

    # ---- loops (run by the runtime in threads) -----------------------------------
    def deliver_events(self) -> None:
        """Have the transport's own threads hand events to :meth:`_handle_event` where
        they saw them (no hand-off; :meth:`kvbeam.transport.base.Transport.deliver_to`);
        the runtime's events thread pumps the rest."""
        self.rt.transport.deliver_to(self._handle_event)

    def _handle_event(self, event: Event) -> None:
        """One transport event, on whichever thread delivers it; never raises."""
        try:
            self.on_event(event)
        except Exception:  # one bad event must not stop the delivering thread
            log.exception("handling transport event %s failed", event)

    def sweep(self) -> None:
        """Enforce deadlines (called every SWEEP_S by the runtime)."""
        now = self.rt.clock()
        for snap in self.table.expire(now):
            # The same words as every other failure ("request X failed: reason: detail"):
            # operators and the compose test grep for them; the peer is in the fields.
            log.warning("request %s failed: timeout: %s", snap.request_id, snap.detail,
                        extra=fields(snap.request_id, snap.peer))
            self.on_expired(snap)
        self._drop_unchanneled(now)
        self.periodic()

    def _drop_unchanneled(self, now: float) -> None:
        """Drop every connection that has had no open peer channel for the peer timeout:
        the channel carries its heartbeats, so nothing else would notice that its peer
        went (decode's connection whose prefill never sent its HELLO, or whose channel
        prefill closed and did not replace). Its link is released and its requests go
        on as after a link failure (resent on a new link, else their deadlines)."""
        limit = self.rt.settings.peer_timeout_s
        for conn in self.rt.peers.all():
            idle = conn.unchanneled_for(now)
            if idle >= limit and not conn.closed:
                self.rt.peers.remove(conn)
                log.warning("connection to peer %s (%s) dropped: no open peer channel for "
                            "%.1f s (the peer timeout is %g s)", conn.instance_id,
                            conn.control_address, idle, limit,
                            extra=fields(peer=conn.control_address))
                self.io.submit(self.peer_lost, conn, f"no open peer channel to "
                               f"{conn.control_address} for {idle:.1f} s", gone=False)
