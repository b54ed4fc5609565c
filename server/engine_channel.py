"""The daemon's end of the engine channel: an attached engine's per-request calls, pushed states.

After an attach, the attach socket carries binary frames (:mod:`kvbeam.proto.engine_frames`).
:class:`EngineChannel` is driven by the attach server's one thread: it reads what
arrived (no thread per message or per request), decodes every complete frame
(strictly: a malformed one gets an ERROR frame naming the field, an oversize length
ends the connection before its body is read) and calls the role's core through its
existing entry points (:class:`CoreOps`): calls that may block (decode's Offer to its
prefill, an abort that waits for writes to drain) run on the daemon's bounded executor.

Every state change of a request the engine started on this channel is pushed back
as a STATE frame (only Success and Failed when the engine attached with ``pushes:
final``): the transfer table's observer (:meth:`EngineChannel.on_change`, any
thread) sends the encoded frame at once, non-blocking, under a leaf lock, when nothing
is queued before it (no hand-off to another thread: the usual case); what the socket
does not take is queued in the outbound buffer, and the attach thread, woken, writes
it when the socket is writable (also non-blocking, under the same lock, so frames keep
their order).

On decode a request's Failed is pushed once its pages are free (``failed_when_freed``):
the table fails a request at once, but decode frees its pages only when prefill can no
longer write into them (prefill confirmed its writes drained, or their link is gone),
and an engine frees a request's pages on Failed, so a Failed pushed earlier let the
engine hand them to its next request while the old one still held them. The decode
core's ``on_freed`` (:meth:`EngineChannel.on_freed`) releases the parked state.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Protocol

from kvbeam.errors import BadRequest, KvbeamError
from kvbeam.proto import engine_frames as ef
from kvbeam.proto.fields import host_port
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.validation import request_id_of, seq_len_of
from kvbeam.states import TransferState, TransferStatus

log = logging.getLogger(__name__)

#: Bytes read per readable event.
READ_CHUNK = 1 << 18
#: Pushed bytes an engine may leave unread before the daemon drops it (it stopped reading).
MAX_OUTBOUND_BYTES = 64 << 20


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
        core.send(frame.request_id, -1, seq_len, frame.decode_address, list(frame.chunks),
                  frame.final, indices=frame.indices, draft=frame.draft,
                  kv_offset=frame.kv_offset)

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

    def abort(self, frame: ef.Abort) -> None:
        self._core().abort(frame.request_id, from_peer=False,
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
        # Leaf: _out, _mine, _parked, _freed, _conn, _final_only; held across a
        # non-blocking send on the engine socket only (frames keep their order).
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
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False
        #: Frames handled and states pushed (diagnostics, the benchmark).
        self.frames_in = 0
        self.frames_out = 0

    @property
    def wake_fd(self) -> socket.socket:
        """Readable when pushed states wait to be written (the attach loop selects it)."""
        return self._wake_r

    def bind(self, conn: socket.socket, *, final_only: bool = False) -> None:
        """An engine attached on ``conn``: frames follow its attach reply. ``final_only``:
        it asked to hear only of its requests' ends (attach ``pushes: final``)."""
        conn.setblocking(False)
        with self._lock:
            self._conn = conn
            self._final_only = final_only
            self._out = bytearray()
            self._mine = set()
            self._parked, self._freed = {}, set()
            self._frames = ef.FrameBuffer()

    def unbind(self) -> None:
        """The engine detached: nothing more is pushed (its requests fail as before)."""
        with self._lock:
            self._conn = None
            self._out = bytearray()
            self._mine = set()
            self._parked, self._freed = {}, set()

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

    def _push(self, data: bytes) -> None:
        """Send ``data`` now when nothing is queued before it (one non-blocking send on
        the pushing thread: no wake-up of the attach thread, no hand-off); else, or for
        what the socket did not take, queue it for the attach thread."""
        with self._lock:
            conn = self._conn
            if conn is None:
                return
            self.frames_out += 1
            if not self._out:  # in order: every earlier frame is already on the socket
                try:
                    sent = conn.send(data)
                except OSError:  # full (BlockingIOError), or broken: flush() finds out
                    sent = 0
                if sent == len(data):
                    return
                data = data[sent:]
            self._out += data
            wake = not self._woken
            self._woken = True
        if wake:
            with contextlib.suppress(BlockingIOError, OSError):
                self._wake_w.send(b"\0")

    # ---- the attach thread --------------------------------------------------------------
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
        """Read what arrived and handle every complete frame; returns JSON messages
        (attach protocol: the detach) for the attach server.

        Raises:
            EOFError: the engine closed the socket.
            ef.FrameError: an oversize length (the stream cannot be resynchronised);
                the ERROR frame is already queued.
        """
        try:
            data = conn.recv(READ_CHUNK)
        except BlockingIOError:
            return []
        if not data:
            raise EOFError("end of stream")
        try:
            bodies = self._frames.feed(data)
        except ef.FrameError as exc:
            self.push_error("", exc.field, str(exc))
            raise
        json_messages = []
        for body in bodies:
            if body[:1] == b"{":
                json_messages.append(body)
                continue
            self.handle(body)
        return json_messages

    def handle(self, body: bytes) -> None:
        """Decode and run one engine frame; any refusal becomes an ERROR frame."""
        self.frames_in += 1
        try:
            frame = ef.decode(body)
        except ef.FrameError as exc:
            log.warning("engine frame refused: %s", exc)
            self.push_error(exc.request_id, exc.field, str(exc))
            return
        assert not isinstance(frame, ef.State | ef.Error)  # decode() allows engine kinds only
        rid = frame.request_id
        try:
            request_id_of(rid)
        except KvbeamError as exc:
            self.push_error(rid[:128], "request_id", str(exc))
            return
        if isinstance(frame, ef.Abort | ef.Decline):
            self.io.submit(self._run, frame)  # an RPC to the peer (an abort drains first)
            return
        self._run(frame)

    def _run(self, frame: ef.EngineFrame) -> None:
        rid = frame.request_id
        starts = isinstance(frame, ef.Reserve | ef.Send)
        with self._lock:
            new = starts and rid not in self._mine
            if new:
                self._mine.add(rid)  # before the core creates it: its first state is pushed
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
            if new:
                with self._lock:
                    self._mine.discard(rid)
            if not isinstance(exc, KvbeamError):
                log.exception("engine frame for request %s failed unexpectedly", rid)
            self.push_error(rid, _field_of(exc, frame), f"{type(exc).__name__}: {exc}")
            self.ops.refused(frame, exc)  # after the ERROR: the engine reads that first
