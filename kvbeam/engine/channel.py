"""The engine's end of the engine channel: per-request frames out, pushed states in.

An :class:`~kvbeam.engine.attach.Attachment` whose daemon speaks the channel owns one
:class:`EngineChannel`: writes go straight to the attach socket (:meth:`EngineChannel.send`,
several in one write inside :meth:`EngineChannel.batch`), and ONE reader thread applies
every pushed STATE to the request's :class:`RequestState`, so a scheduler's
``poll()`` is an attribute read (no syscall, no RPC), ``wait()`` blocks on a condition
and :meth:`EngineChannel.poll_many` / :meth:`EngineChannel.events` hand over every
change at once. The socket closing fails every request still in flight (the daemon
detached them too). No gRPC, no torch.

A frame the daemon refuses (an ERROR: an early RELEASE, a second RESERVE of a live id)
is an error of that call, not a state: the request's record keeps its state and gets the
refusal (:attr:`RequestState.refusal`, a WARNING in the log). Failed comes only from the
daemon (it pushes one after the ERROR when it holds nothing of the request) or from the
socket closing, so an engine may take Failed to mean the daemon let go of the request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvbeam.proto import engine_frames as ef
from kvbeam.states import FailureReason, TransferState
from kvbeam.threads import name_os_thread

log = logging.getLogger(__name__)

#: Bytes read per recv by the reader thread.
READ_CHUNK = 1 << 18


@dataclass(frozen=True)
class RequestEvent:
    """One change of one request, as :meth:`EngineChannel.poll_many` returns it."""

    request_id: str
    state: TransferState
    reason: FailureReason | None
    detail: str


class RequestState:
    """What the engine knows of one request; the reader thread is its only writer."""

    __slots__ = ("detail", "reason", "refusal", "request_id", "state", "version")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.state = TransferState.BOOTSTRAPPING
        self.reason: FailureReason | None = None
        self.detail = ""
        self.version = -1
        #: The daemon's last refusal of one of this request's frames (``field: message``),
        #: "" when none: the frame had no effect, the request's state is the daemon's.
        self.refusal = ""


class EngineChannel:
    """Frames to the daemon, states from it, over an attached socket.

    Args:
        sock: the attach socket (after the attach reply).
        path: the socket's path (for messages).
        on_closed: called once with the reason when the channel closes (on the thread
            that noticed; no lock held): the attachment's re-attach starts there.
        closed_note: added to the reason that requests started after the close fail
            with (what the engine does about it: re-attaching).
    """

    def __init__(self, sock: socket.socket, path: str,
                 on_closed: Callable[[str], None] | None = None, closed_note: str = "") -> None:
        self.sock = sock
        self.path = path
        self._on_closed = on_closed
        self._closed_note = closed_note
        self._lock = threading.Lock()  # the request table, the events, the batch
        self._changed = threading.Condition(self._lock)
        self._write_lock = threading.Lock()  # one writer at a time on the socket
        self._requests: dict[str, RequestState] = {}
        self._events: deque[RequestEvent] = deque()
        self._batch: list[bytes] | None = None
        self._json: deque[object] = deque()  # attach-protocol replies (the detach's)
        self.closed_reason = ""
        self._reader = threading.Thread(target=self._read_loop, name="kvbeam-engine-channel",
                                        daemon=True)
        self._reader.start()

    # ---- requests ----------------------------------------------------------------------
    def track(self, request_id: str) -> RequestState:
        """The request's state record (created Bootstrapping; a live one is kept)."""
        with self._lock:
            rec = self._requests.get(request_id)
            if rec is None or rec.state.terminal:
                rec = self._requests[request_id] = RequestState(request_id)
                if self.closed_reason:
                    self._apply(rec, TransferState.FAILED, FailureReason.SHUTDOWN,
                                self.closed_reason, rec.version + 1)
            return rec

    def send(self, frame: ef.EngineFrame) -> None:
        """Write one frame now, or add it to the open :meth:`batch`."""
        data = ef.encode(frame)
        with self._lock:
            if self._batch is not None:
                self._batch.append(data)
                return
        self._write(data)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Frames sent inside the block leave in one write at its end."""
        with self._lock:
            outer = self._batch is not None
            if not outer:
                self._batch = []
        try:
            yield
        finally:
            if not outer:
                with self._lock:
                    frames, self._batch = self._batch or [], None
                if frames:
                    self._write(b"".join(frames))

    def send_raw(self, data: bytes) -> None:
        """Write an attach-protocol message (the detach) on the channel's socket."""
        with self._write_lock:
            self.sock.sendall(data)

    def _write(self, data: bytes) -> None:
        if self.closed_reason:
            return  # every request already failed with the reason
        try:
            with self._write_lock:
                self.sock.sendall(data)
        except OSError as exc:
            self._closed(f"the attach socket to the daemon on {self.path} broke: {exc}")

    def wait(self, rec: RequestState, timeout: float) -> TransferState:
        """Block until ``rec`` is terminal or ``timeout`` seconds pass; its state then."""
        end = time.monotonic() + timeout
        with self._changed:
            while not rec.state.terminal:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return rec.state

    def poll_many(self) -> list[RequestEvent]:
        """Every change since the last call (oldest first), for all requests at once."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def events(self, timeout: float | None = None) -> Iterator[RequestEvent]:
        """Yield changes as they come; stops after ``timeout`` seconds without one
        (None: until the channel closes)."""
        while True:
            with self._changed:
                if not self._events:
                    if self.closed_reason:
                        return
                    self._changed.wait(timeout)
                if not self._events:
                    if timeout is not None or self.closed_reason:
                        return
                    continue
                ev = self._events.popleft()
            yield ev

    def take_json(self, timeout: float) -> object:
        """The next attach-protocol message the daemon sent (the detach reply)."""
        end = time.monotonic() + timeout
        with self._changed:
            while not self._json:
                left = end - time.monotonic()
                if left <= 0 or (self.closed_reason and not self._json):
                    raise EOFError(self.closed_reason or "no answer from the daemon in time")
                self._changed.wait(left)
            return self._json.popleft()

    def note_closed(self, reason: str) -> None:
        """What requests started on this closed channel fail with from now on (the
        attachment says it is re-attaching, and how far it got)."""
        with self._lock:
            if self.closed_reason:
                self.closed_reason = reason

    # ---- the reader thread -------------------------------------------------------------
    def _apply(self, rec: RequestState, state: TransferState, reason: FailureReason | None,
               detail: str, version: int) -> None:
        """Under the lock: record a change, queue its event."""
        rec.state, rec.reason, rec.detail, rec.version = state, reason, detail, version
        self._events.append(RequestEvent(rec.request_id, state, reason, detail))
        if state.terminal and self._requests.get(rec.request_id) is rec:
            del self._requests[rec.request_id]  # the Sender/Receiver keeps its record

    def _read_loop(self) -> None:
        name_os_thread()
        frames = ef.FrameBuffer()
        reason = ""
        while True:
            try:
                data = self.sock.recv(READ_CHUNK)
            except OSError as exc:
                reason = f"the attach socket to the daemon on {self.path} broke: {exc}"
                break
            if not data:
                reason = f"the daemon on {self.path} closed the attach socket"
                break
            try:
                bodies = frames.feed(data)
            except ef.FrameError as exc:
                reason = f"unreadable frame from the daemon on {self.path}: {exc}"
                break
            with self._changed:
                for body in bodies:
                    self._handle(body)
                self._changed.notify_all()
        self._closed(reason)

    def _handle(self, body: bytes) -> None:
        """Under the lock: one frame from the daemon."""
        if body[:1] == b"{":
            try:
                self._json.append(json.loads(body))
            except ValueError:
                log.warning("unreadable attach message from the daemon on %s", self.path)
            return
        try:
            frame = ef.decode(body, (ef.STATE, ef.ERROR))
        except ef.FrameError as exc:
            log.warning("frame from the daemon on %s refused: %s", self.path, exc)
            return
        rec = self._requests.get(frame.request_id)
        if isinstance(frame, ef.State):
            if rec is not None and frame.version > rec.version:
                self._apply(rec, frame.state, frame.reason, frame.detail, frame.version)
            return
        assert isinstance(frame, ef.Error)
        # An error of that call, not a state: the daemon still holds what it held (it
        # pushes Failed itself when it holds nothing of the request).
        log.warning("the daemon on %s refused a frame%s: %s: %s", self.path,
                    f" of request {frame.request_id}" if frame.request_id else "",
                    frame.field, frame.message)
        if rec is not None:
            rec.refusal = f"{frame.field}: {frame.message}"

    def _closed(self, reason: str) -> None:
        with self._changed:
            if self.closed_reason:
                return
            self.closed_reason = reason + self._closed_note
            for rec in list(self._requests.values()):
                if not rec.state.terminal:
                    self._apply(rec, TransferState.FAILED, FailureReason.SHUTDOWN, reason,
                                rec.version + 1)
            self._changed.notify_all()
        log.warning("engine channel closed: %s", reason)
        if self._on_closed is not None:
            self._on_closed(reason)

    def close(self) -> None:
        """Fail what is in flight and stop the reader (the socket is closed by its owner)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._closed(f"the engine closed its attachment to {self.path}")
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
