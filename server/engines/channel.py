"""The daemon's end of the engine channel: an attached engine's per-request calls, pushed states.

After an attach, the attach socket carries binary frames (:mod:`kvbeam.proto.engine_frames`).
:class:`EngineChannel` is driven by the daemon's loop (the attach server's source): it reads what
arrived (no thread per message or per request), decodes every complete frame
(strictly: a malformed one gets an ERROR frame naming the field, an oversize length
ends the connection before its body is read) and calls the role's core through its
existing entry points (:class:`CoreOps`): calls that may block (decode's Offer to its
prefill, an abort that waits for writes to drain) run on the daemon's bounded executor.

Every state change of a request the engine started on this channel is pushed back
as a STATE frame (only Success and Failed when the engine attached with ``pushes:
final``): the transfer table's observer (:meth:`EngineChannel.on_change`, on the
daemon's loop, where the table changes) sends the encoded frame at once, non-blocking,
under a leaf lock, when nothing is queued before it (no hand-off to another thread: the
usual case); what the socket does not take is queued in the outbound buffer, and the
loop thread, woken, writes it when the socket is writable (also non-blocking, under the
same lock, so frames keep their order).

On decode a request's Failed is pushed once its pages are free (``failed_when_freed``):
the table fails a request at once, but decode frees its pages only when prefill can no
longer write into them (prefill confirmed its writes drained, or their link is gone),
and an engine frees a request's pages on Failed, so a Failed pushed earlier let the
engine hand them to its next request while the old one still held them. The decode
core's ``on_freed`` (:meth:`EngineChannel.on_freed`) releases the parked state.

A refused frame is an ERROR for that call, not a state: the request stays as the daemon
holds it. Only where the refused frame leaves the daemon holding nothing of the engine's
request (a RESERVE or first SEND refused outright) does the channel push Failed after
the ERROR, so the engine still ends it (docs/engine.md, "What Failed means").

Per engine, at most :data:`MAX_QUEUED_FRAMES` frames wait for (or run on) the executor;
beyond that the channel stops reading the engine's socket (:attr:`EngineChannel.paused`)
and holds what it already read, until the executor caught up (backpressure: the engine's
writes block, nothing grows without bound). An ABORT of a request the daemon does not
know is answered at once, without the executor (nothing to drain).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Protocol

from kvbeam.errors import BadRequest, KvbeamError
from kvbeam.proto import engine_frames as ef
from kvbeam.proto.fields import host_port
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.core.validation import request_id_of, seq_len_of
from kvbeam.states import FailureReason, TransferState, TransferStatus

log = logging.getLogger(__name__)

#: Bytes read per readable event.
READ_CHUNK = 1 << 18
#: Pushed bytes an engine may leave unread before the daemon drops it (it stopped reading).
MAX_OUTBOUND_BYTES = 64 << 20
#: An engine's frames waiting for (or running on) the executor, at most; at the bound the
#: channel stops reading the engine's socket until they are down to :data:`RESUME_AT`.
MAX_QUEUED_FRAMES = 256
RESUME_AT = MAX_QUEUED_FRAMES // 2
#: The frame kinds that start a request (their refusal may leave the daemon holding nothing).
_STARTS = (ef.RESERVE, ef.SEND)


class EngineOps(Protocol):
    """The role's core as the channel drives it (one method per engine frame)."""

    def reserve(self, frame: ef.Reserve) -> None:
        """Decode: hold the request at the engine's lists, offer it to its prefill."""

    def send(self, frame: ef.Send) -> None:
        """Prefill: queue (a chunk of) the request."""

    def abort(self, frame: ef.Abort) -> None:
        """Either: abort the request (may block: called on the executor)."""

    def release(self, frame: ef.Release) -> None:
        """Decode: the engine took the KV over."""

    def decline(self, frame: ef.Decline) -> None:
        """Decode: tell prefill the request will not be loaded (may block: executor)."""

    def refused(self, frame: ef.EngineFrame, exc: Exception) -> None:
        """A frame was refused (its ERROR already queued): end what it leaves half done."""

    def holds(self, request_id: str) -> bool:
        """Whether the core holds the request live (created and not ended)."""

    def known(self, request_id: str) -> bool:
        """Whether the core has any record of the request (live or ended; prefill: or an
        offer of it)."""


class CoreOps:
    """:class:`EngineOps` over a daemon's core, with the gRPC handlers' field checks."""

    def __init__(self, role: str, core: Callable[[], DecodeDriver | PrefillDriver],
                 max_context_len: Callable[[], int]) -> None:
        self.role = role
        self._core = core
        self._max_len = max_context_len

    def _seq_len(self, value: int) -> int:
        return seq_len_of(value, self._max_len())

    def reserve(self, frame: ef.Reserve) -> None:
        core = self._core()
        if not isinstance(core, DecodeDriver):
            raise ef.FrameError("kind", "RESERVE is decode's; this is a prefill daemon",
                                frame.request_id)
        if not frame.indices:
            # Without lists the core would reserve at the slot's own pages, which this
            # engine never named (the gRPC API's --pools own default).
            raise ef.FrameError("lists", "a RESERVE names the engine's destination lists "
                                "(KV_PAGES and every other kind its layout uses); this one "
                                "has none", frame.request_id)
        seq_len = self._seq_len(frame.seq_len)
        host_port(frame.prefill_address, "prefill_address")
        res = core.reserve(frame.request_id, seq_len, frame.prefill_address,
                           indices=frame.indices, draft=frame.draft, kv_skip=frame.kv_skip)
        core.offer(res)  # one-way: an answer, if prefill sends one, is handled where it lands

    def send(self, frame: ef.Send) -> None:
        core = self._core()
        if not isinstance(core, PrefillDriver):
            raise ef.FrameError("kind", "SEND is prefill's; this is a decode daemon",
                                frame.request_id)
        seq_len = self._seq_len(frame.seq_len)
        if frame.decode_address:  # empty: the decode whose reservation names it
            host_port(frame.decode_address, "decode_address")
        core.send(frame.request_id, seq_len, frame.decode_address, [], frame.final,
                  indices=frame.indices, draft=frame.draft,
                  kv_offset=frame.kv_offset, layers=frame.layers)

    def refused(self, frame: ef.EngineFrame, exc: Exception) -> None:
        core = self._core()
        if (isinstance(frame, ef.Send) and frame.kv_offset is not None
                and isinstance(exc, ef.FrameError | BadRequest)  # the piece, not a duplicate
                and isinstance(core, PrefillDriver) and core.known(frame.request_id)):
            # A refused piece of a request under way: its earlier chunks may be written,
            # and no later piece can complete it. Fail it now (decode frees its pages once
            # prefill's writes drained) rather than at its deadline; on the executor,
            # since the abort waits for the drain.
            core.io.submit(core.abort, frame.request_id, from_peer=False,
                           detail=f"a SEND piece was refused: {exc}")

    def holds(self, request_id: str) -> bool:
        return self._core().table.is_live(request_id)

    def known(self, request_id: str) -> bool:
        core = self._core()
        if core.table.state_of(request_id) is not None:
            return True
        # Prefill may hold decode's offer of a request it has not sent: an abort drops it.
        return isinstance(core, PrefillDriver) and core.core.offers.has(request_id)

    def abort(self, frame: ef.Abort) -> None:
        core = self._core()
        # On the daemon's loop, where prefill's abort never waits for the writes to drain
        # (their completions come through this thread): decode is told once they did.
        core.abort(frame.request_id, from_peer=False,
                   detail=frame.detail or "aborted by the engine")

    def release(self, frame: ef.Release) -> None:
        core = self._core()
        if not isinstance(core, DecodeDriver):
            raise ef.FrameError("kind", "RELEASE is decode's; this is a prefill daemon",
                                frame.request_id)
        core.release(frame.request_id)

    def decline(self, frame: ef.Decline) -> None:
        core = self._core()
        if not isinstance(core, DecodeDriver):
            raise ef.FrameError("kind", "DECLINE is decode's; this is a prefill daemon",
                                frame.request_id)
        host_port(frame.prefill_address, "prefill_address")
        core.decline(frame.request_id, frame.prefill_address,
                     frame.detail or "declined by decode's engine")


def _field_of(exc: BaseException, frame: ef.EngineFrame) -> str:
    found = getattr(exc, "field", "")
    return found if isinstance(found, str) and found else ef.KIND_NAMES.get(
        {ef.Reserve: ef.RESERVE, ef.Send: ef.SEND, ef.Abort: ef.ABORT,
         ef.Release: ef.RELEASE, ef.Decline: ef.DECLINE}[type(frame)], "frame").lower()


class EngineChannel:
    """One daemon's engine channel; :meth:`bind` at each attach, :meth:`unbind` at detach.

    Args:
        ops: the role's core (:class:`CoreOps`).
        io: the daemon's bounded executor (blocking calls run there).
        failed_when_freed: push a request's Failed only at :meth:`on_freed` (decode: its
            pages are free then), not when the table fails it.
    """

    def __init__(self, ops: EngineOps, io: Executor, *, failed_when_freed: bool = False) -> None:
        self.ops = ops
        self.io = io
        self.failed_when_freed = failed_when_freed
        # Leaf: _out, _mine, _parked, _freed, _conn, _final_only, _queued, _paused,
        # _binding; held across a non-blocking send on the engine socket only (frames keep
        # their order).
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        #: The attached engine hears only of its requests' ends (attach ``pushes: final``).
        self._final_only = False
        self._out = bytearray()
        self._mine: set[str] = set()
        #: Failed states waiting for their request's pages to be freed (failed_when_freed).
        self._parked: dict[str, TransferStatus] = {}
        #: The engine's live requests freed before the table failed them (their Failed
        #: then goes out at once).
        self._freed: set[str] = set()
        self._frames = ef.FrameBuffer()
        #: Frame bodies read but not handled yet: the executor queue was full (attach
        #: thread only).
        self._held: deque[bytes] = deque()
        #: This binding's frames waiting for or running on the executor.
        self._queued = 0
        #: Reading the socket stops while this is set (the executor queue is full).
        self._paused = False
        #: Counts binds: an executor job of an earlier engine does not count for this one.
        self._binding = 0
        #: Set while the loop thread handles a read's frames: pushes queue, and go out
        #: in one write at its end (not one send per answer).
        self._corked = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False

    @property
    def wake_fd(self) -> socket.socket:
        """Readable when pushed states wait to be written, or when a paused channel may
        read again (the daemon's loop selects it)."""
        return self._wake_r

    @property
    def paused(self) -> bool:
        """True while the engine's socket must not be read (backpressure): the executor
        holds :data:`MAX_QUEUED_FRAMES` of its frames, or frames already read wait."""
        with self._lock:
            return self._paused

    @property
    def can_resume(self) -> bool:
        """Paused, and the executor caught up: the held frames may be handled now."""
        with self._lock:
            return self._paused and self._queued <= RESUME_AT

    def wake(self) -> None:
        """Make the daemon's loop come back to this channel (its wake fd turns readable)."""
        self._wake()

    @property
    def pending_output(self) -> bool:
        """Pushed bytes the socket did not take yet (the daemon's loop waits for writability)."""
        with self._lock:
            return bool(self._out)

    def bind(self, conn: socket.socket, *, final_only: bool = False) -> None:
        """An engine attached on ``conn``: frames follow its attach reply. ``final_only``:
        it asked to hear only of its requests' ends (attach ``pushes: final``)."""
        conn.setblocking(False)
        with self._lock:
            self._conn = conn
            self._final_only = final_only
            self._reset()

    def unbind(self) -> None:
        """The engine detached: nothing more is pushed (its requests fail as before)."""
        with self._lock:
            self._conn = None
            self._reset()

    def _reset(self) -> None:
        """Under the lock: forget the last engine's requests, queues and bytes."""
        self._out = bytearray()
        self._mine = set()
        self._parked, self._freed = {}, set()
        self._frames = ef.FrameBuffer()
        self._held = deque()
        self._queued, self._paused = 0, False
        self._binding += 1

    def close(self) -> None:
        """Close the wake pair (daemon stop)."""
        self.unbind()
        self._wake_r.close()
        self._wake_w.close()

    # ---- pushed states (any thread) -----------------------------------------------------
    def on_change(self, snap: TransferStatus) -> None:
        """The transfer table's observer: push the change when the engine started it here."""
        rid = snap.request_id
        with self._lock:
            if rid not in self._mine or self._conn is None:
                return
            if snap.state.terminal:
                self._mine.discard(rid)
            elif self._final_only:  # the engine acts only on the end: no wake-up before it
                return
            if (self.failed_when_freed and snap.state is TransferState.FAILED
                    and rid not in self._freed):
                self._parked[rid] = snap  # pushed by on_freed, once the pages are free
                return
            self._freed.discard(rid)
        self._push_state(snap)

    def on_freed(self, request_id: str) -> None:
        """The core freed a request's pages and slot (any thread, no lock held): push
        its parked Failed now (``failed_when_freed``)."""
        with self._lock:
            snap = self._parked.pop(request_id, None)
            if snap is None and request_id in self._mine:
                self._freed.add(request_id)  # freed before it failed: push Failed at once
        if snap is not None:
            self._push_state(snap)

    def _push_state(self, snap: TransferStatus) -> None:
        self._push(ef.encode_state(snap.request_id, snap.state, snap.reason, snap.version,
                                   snap.detail))

    def push_error(self, request_id: str, field: str, message: str) -> None:
        """Tell the engine a frame was refused (any thread)."""
        self._push(ef.encode(ef.Error(request_id, field, message)))

    def push_message(self, data: bytes) -> None:
        """Send an attach-protocol message (a framed JSON reply) in order with the pushed
        states (any thread)."""
        self._push(data)

    def _ended_here(self, request_id: str, field: str, message: str) -> None:
        """A frame that would have started ``request_id`` was refused and the daemon holds
        nothing of it: push Failed after the ERROR, so the engine ends its record (the
        pages it named were never taken)."""
        self._push(ef.encode_state(request_id, TransferState.FAILED,
                                   FailureReason.INVALID_REQUEST, 0, f"{field}: {message}"))

    def _engines(self, request_id: str) -> bool:
        """Whether the daemon holds ``request_id`` for this engine: started here and not
        pushed terminal, or Failed but its pages not yet freed."""
        with self._lock:
            return request_id in self._mine or request_id in self._parked

    def _push(self, data: bytes) -> None:
        """Send ``data`` now when nothing is queued before it (one non-blocking send on
        the pushing thread: no wake-up of the loop thread, no hand-off); else, or for
        what the socket did not take, queue it for the loop thread."""
        with self._lock:
            conn = self._conn
            if conn is None:
                return
            if self._corked:  # the loop thread writes it at the end of its batch
                self._out += data
                return
            if not self._out:  # in order: every earlier frame is already on the socket
                try:
                    sent = conn.send(data)
                except OSError:  # full (BlockingIOError), or broken: flush() finds out
                    sent = 0
                if sent == len(data):
                    return
                data = data[sent:]
            self._out += data
        self._wake()

    def _wake(self) -> None:
        """Wake the loop thread (once until it runs :meth:`flush`)."""
        with self._lock:
            wake = not self._woken
            self._woken = True
        if wake:
            with contextlib.suppress(BlockingIOError, OSError):
                self._wake_w.send(b"\0")

    # ---- the loop thread --------------------------------------------------------------
    def flush(self) -> bool:
        """Write what is queued (non-blocking); True when nothing is left.

        Raises:
            OSError: the socket broke, or the engine left more than MAX_OUTBOUND_BYTES
                unread (the caller detaches it).
        """
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        with self._lock:  # the send under the lock: a pushing thread's sends stay in order
            self._woken = False
            conn = self._conn
            if conn is None or not self._out:
                return True
            try:
                sent = conn.send(self._out)
            except BlockingIOError:
                sent = 0
            del self._out[:sent]
            left = len(self._out)
        if not left:
            return True
        if left > MAX_OUTBOUND_BYTES:
            raise OSError(f"the engine left {left} bytes of pushed states unread (limit "
                          f"{MAX_OUTBOUND_BYTES}): it stopped reading its attach socket")
        return False

    def readable(self, conn: socket.socket) -> list[bytes]:
        """Handle the frames held back (if the executor caught up), then read what
        arrived and handle every complete frame; returns JSON messages (attach protocol:
        the detach) for the attach server. Reads nothing while :attr:`paused`.

        Raises:
            EOFError: the engine closed the socket.
            ef.FrameError: an oversize length (the stream cannot be resynchronised);
                the ERROR frame is already queued.
        """
        json_messages: list[bytes] = []
        if self._held:
            with self._lock:
                if self._queued > RESUME_AT:
                    return []
                self._paused = False
            held, self._held = list(self._held), deque()
            json_messages += self._handle_all(held)
            if self._held:
                return json_messages
        try:
            data = conn.recv(READ_CHUNK)
        except BlockingIOError:
            return json_messages
        if not data:
            raise EOFError("end of stream")
        try:
            bodies = self._frames.feed(data)
        except ef.FrameError as exc:
            self.push_error("", exc.field, str(exc))
            raise
        return json_messages + self._handle_all(bodies)

    def _handle_all(self, bodies: list[bytes]) -> list[bytes]:
        """Handle ``bodies`` in order until the executor queue is full; hold the rest
        (and pause reading). Returns the JSON messages among those handled. What they
        push leaves in one write at the end.

        Raises:
            OSError: the engine left more than MAX_OUTBOUND_BYTES unread.
        """
        with self._lock:
            self._corked = True
        try:
            return self._handle_each(bodies)
        finally:
            with self._lock:
                self._corked = False
            self.flush()

    def _handle_each(self, bodies: list[bytes]) -> list[bytes]:
        json_messages = []
        for i, body in enumerate(bodies):
            with self._lock:
                full = self._queued >= MAX_QUEUED_FRAMES
                if full:
                    self._paused = True
            if full:
                self._held.extend(bodies[i:])
                break
            if body[:1] == b"{":
                json_messages.append(body)
                continue
            self.handle(body)
        return json_messages

    def handle(self, body: bytes) -> None:
        """Decode and run one engine frame; any refusal becomes an ERROR frame."""
        try:
            frame = ef.decode(body)
        except ef.FrameError as exc:
            log.warning("engine frame refused: %s", exc)
            self._refuse_unread(body, exc.request_id, exc.field, str(exc))
            return
        assert not isinstance(frame, ef.State | ef.Error)  # decode() allows engine kinds only
        rid = frame.request_id
        try:
            request_id_of(rid)
        except KvbeamError as exc:
            self._refuse_unread(body, rid[:128], "request_id", str(exc))
            return
        if isinstance(frame, ef.Abort) and not self._engines(rid) and not self.ops.known(rid):
            # Nothing to abort: refused here, at once (no drain, no peer call, no core).
            self.push_error(rid, "abort", f"UnknownRequest: unknown request id {rid!r} on "
                                          "this daemon: nothing to abort")
            return
        if isinstance(frame, ef.Abort | ef.Decline):
            with self._lock:
                self._queued += 1
                binding = self._binding
            self.io.submit(self._run_queued, frame, binding)  # a peer call (an abort drains)
            return
        self._run(frame)

    def _refuse_unread(self, body: bytes, request_id: str, field: str, message: str) -> None:
        """ERROR for a frame that could not be read; a RESERVE or SEND that would have
        started a request the daemon holds nothing of also ends it (Failed)."""
        self.push_error(request_id, field, message)
        if request_id and body[1:2] and body[1] in _STARTS and not self._engines(request_id):
            self._ended_here(request_id, field, message)

    def _run_queued(self, frame: ef.EngineFrame, binding: int) -> None:
        """An executor job: run the frame, then let the loop thread read on if the
        queue came down to :data:`RESUME_AT`."""
        try:
            self._run(frame)
        finally:
            with self._lock:
                mine = binding == self._binding
                if mine:
                    self._queued -= 1
                resume = mine and self._paused and self._queued <= RESUME_AT
            if resume:
                self._wake()

    def _run(self, frame: ef.EngineFrame) -> None:
        rid = frame.request_id
        starts = isinstance(frame, ef.Reserve | ef.Send)
        with self._lock:
            new = starts and rid not in self._mine and rid not in self._parked
            if new:
                self._mine.add(rid)  # before the core creates it: its first state is pushed
        # A record already there (someone else's, or one that ended) is not this frame's.
        fresh = new and not self.ops.known(rid)
        try:
            if isinstance(frame, ef.Reserve):
                self.ops.reserve(frame)
            elif isinstance(frame, ef.Send):
                self.ops.send(frame)
            elif isinstance(frame, ef.Abort):
                self.ops.abort(frame)
            elif isinstance(frame, ef.Decline):
                self.ops.decline(frame)
            else:
                self.ops.release(frame)
        except Exception as exc:
            # Held when the core created the request before refusing (its end is pushed
            # as usual); a record that was there before is not this frame's.
            held = fresh and self.ops.holds(rid)
            if new and not held:
                with self._lock:
                    self._mine.discard(rid)
            if not isinstance(exc, KvbeamError):
                log.exception("engine frame for request %s failed unexpectedly", rid)
            field, message = _field_of(exc, frame), f"{type(exc).__name__}: {exc}"
            self.push_error(rid, field, message)
            if new and not held:
                self._ended_here(rid, field, message)
            self.ops.refused(frame, exc)  # after the ERROR: the engine reads that first
