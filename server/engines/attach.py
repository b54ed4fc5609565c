"""The daemon's attach socket: a local engine hands over its pools (``--pools engine``).

The daemon's loop (:mod:`kvbeam.loop`) serves a Unix stream socket (mode
0600, set before listen, or 0660 in ``--attach-group``; its directory must not be
writable by others). A
connecting engine is checked by its peer credentials (SO_PEERCRED: the daemon's uid
or one of ``--attach-allow-uid``) as soon as it is accepted, before a byte of it is
read: a stranger gets a refusal and the connection closed. An allowed engine then has
:data:`READ_TIMEOUT_S` in all to send its one attach message with its memfds
(:mod:`kvbeam.proto.attach_codec`), and keeps the connection open: its lifetime is
the attachment. A detach message, the
socket closing or the engine dying ends it; the runtime then fails the requests on
that memory and unmaps it, and the next engine may attach. One engine at a time: a
second one is refused with the first one's pid, unless the attached one's socket is
already closed (an engine that closed and attached again at once): that detach is
done first.

Nothing a client does stalls the loop: every socket is non-blocking, the attach and
the detach (the memory's mapping, registration and release) run on the executor and
come back to the loop, accepted connections wait in the loop's selector while their
messages arrive (at most
:data:`MAX_PENDING` at once, each with its own deadline; one more is refused naming the
limit), and the attached engine's frames are read between their pieces. Every refusal
is answered within a bounded size and logged in one line.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import math
import os
import select
import selectors
import socket
import stat
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbeam.errors import AttachError, KvbeamError
from kvbeam.loop import DaemonLoop, SourceSelector, join_loop, leave_loop
from kvbeam.proto.attach_codec import (
    MAX_FDS,
    AttachReply,
    AttachRequest,
    MessageReader,
    bounded,
    decode_body,
    frame,
    reply_to_json,
    request_from_json,
)
from kvbeam.proto.engine_frames import ENGINE_FRAMES_VERSION, FrameError

if TYPE_CHECKING:
    from kvbeam.server.engines.channel import EngineChannel

log = logging.getLogger(__name__)

#: Seconds a connecting engine has to send its whole attach message, however it paces
#: it (the loop serves everything else meanwhile; time the daemon itself spends
#: attaching or detaching another engine does not count).
READ_TIMEOUT_S = 5.0
#: Connections whose attach message is still arriving, at most; one more is refused.
MAX_PENDING = 16
#: The listen backlog: a burst of connections waits in the kernel until the loop
#: accepts them (it accepts everything waiting at each turn).
LISTEN_BACKLOG = 128
#: Bytes read per readable event of a connecting engine, and reads per event (its
#: message arrives between the attached engine's frames).
READ_CHUNK = 1 << 18
READS_PER_EVENT = 4
#: Characters of a refusal quoted in the daemon's log line.
LOG_CHARS = 400
#: Seconds between log lines about refused connections beyond MAX_PENDING.
CROWD_LOG_S = 5.0
_CRED = struct.Struct("3i")
_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


@dataclass(frozen=True)
class PeerCred:
    """The connecting process, as the kernel reports it (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_cred(conn: socket.socket) -> PeerCred:
    """The peer process's pid, uid and gid."""
    pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _CRED.size))
    return PeerCred(pid, uid, gid)


@dataclass
class _Pending:
    """A connection whose attach message is still arriving (loop thread only)."""

    conn: socket.socket
    cred: PeerCred
    deadline: float
    reader: MessageReader = field(default_factory=MessageReader)
    fds: list[int] = field(default_factory=list)
    first: bool = True  # the fds ride with the first bytes: read those with recvmsg

    def close(self) -> None:
        """Close the connection and any fds that came with it."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.conn.close()


def default_socket_path(role: str, listen: str) -> str:
    """``$XDG_RUNTIME_DIR/kvbeam/ROLE-PORT.sock`` (else ``/tmp/kvbeam-UID/...``)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = os.path.join(base, "kvbeam") if base else f"/tmp/kvbeam-{os.getuid()}"
    port = listen.rpartition(":")[2]
    return os.path.join(root, f"{role}-{port}.sock" if port not in ("", "0") else f"{role}.sock")


def _prepare_path(path: str) -> None:
    """Create the directory (0700) if missing, refuse an unsafe one, clear a stale socket."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    st = os.stat(parent)
    if st.st_uid not in (os.getuid(), 0):
        raise AttachError(f"--attach-socket {path}: directory {parent} belongs to uid "
                          f"{st.st_uid}, not this daemon's ({os.getuid()})")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise AttachError(f"--attach-socket {path}: directory {parent} is writable by others "
                          f"(mode {stat.S_IMODE(st.st_mode):o}); use a private directory")
    try:
        old = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(old.st_mode) or old.st_uid != os.getuid():
        raise AttachError(f"--attach-socket {path}: exists and is not this user's socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale: its daemon is gone
        return
    finally:
        probe.close()
    raise AttachError(f"--attach-socket {path}: another daemon listens there")


def _group_id(group: str) -> int:
    """``--attach-group``'s gid (a name or a number)."""
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise AttachError(f"--attach-group {group}: no such group") from None


def _socket_mode(path: str, allow_uids: Sequence[int], group: str) -> None:
    """Give the bound socket its owner-only or group mode (before listen: nobody can
    connect in between). Never world-writable: who may connect is who may attach."""
    if not group:
        os.chmod(path, 0o600)
        others = sorted(u for u in allow_uids if u not in (0, os.getuid()))
        if others:
            log.warning("--attach-allow-uid %s without --attach-group: the socket is mode 0600, "
                        "so only the daemon's uid and root can connect; give --attach-group "
                        "a group those uids are in", ",".join(map(str, others)))
        return
    gid = _group_id(group)
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        raise AttachError(f"--attach-group {group}: cannot give the socket group {gid} (the "
                          "daemon's user must be a member of it)") from None
    os.chmod(path, 0o660)
    parent = os.stat(os.path.dirname(os.path.abspath(path)))
    if not (parent.st_mode & 0o001 or (parent.st_gid == gid and parent.st_mode & 0o010)):
        log.warning("--attach-group %s: the socket's directory (mode %o, gid %d) does not let "
                    "that group reach the socket; give it the group and mode 0710", group,
                    stat.S_IMODE(parent.st_mode), parent.st_gid)


class AttachServer:
    """Serve the attach socket on one thread; the callbacks do the attach and the detach.

    Args:
        path: the socket path.
        allow_uids: uids allowed besides the daemon's own.
        on_attach: checks, maps and registers the memory, returns the new instance id;
            raises (AttachError, ...) to refuse. Owns the fds it is given.
        on_detach: fails the requests on the memory and releases it; gets the reason.
        group: ``--attach-group`` (a name or gid): the socket gets that group and mode
            0660 so its members can connect; "" keeps it 0600 (the daemon's uid, root).
        channel: the engine channel (:mod:`kvbeam.server.engines.channel`) the attached
            socket carries after the attach reply; served by this same thread.
    """

    def __init__(self, path: str, allow_uids: Sequence[int],
                 on_attach: Callable[[AttachRequest, list[int], PeerCred], str],
                 on_detach: Callable[[str], None], *, group: str = "",
                 channel: EngineChannel | None = None,
                 offload: Callable[[Callable[[], None]], object] = lambda job: job()) -> None:
        self.path = path
        #: The engine channel (per-request frames after the attach), None: attach only.
        self.channel = channel
        self.allowed = {os.getuid(), *allow_uids}
        self._on_attach = on_attach
        self._on_detach = on_detach
        self._offload = offload
        #: An attach or a detach runs on the executor: what came meanwhile waits for it
        #: (the loop's; an attach's completion, in order).
        self._busy = False
        self._after_busy: list[Callable[[], None]] = []
        self._loop: DaemonLoop | None = None  # set by start()
        self._owns_loop = False
        self._sel: SourceSelector | None = None
        self._engine: tuple[socket.socket, PeerCred] | None = None
        self._pending: dict[int, _Pending] = {}  # by fd (loop thread only)
        self._plain = MessageReader()  # without a channel: the engine's next message
        self._crowd_refused = 0
        self._crowd_logged = 0.0
        _prepare_path(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            _socket_mode(path, allow_uids, group)
            self._listener.listen(LISTEN_BACKLOG)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def start(self, loop: DaemonLoop | None = None) -> None:
        """Serve on ``loop`` (the daemon's), or on a loop of its own (a thread named
        ``kvbeam-attach``) when none is given."""
        self._loop, self._owns_loop = join_loop(loop, "kvbeam-attach", self._join_loop)
        log.info("waiting for an engine to attach on %s", self.path)

    def _join_loop(self, loop: DaemonLoop) -> None:
        """Become a source of ``loop``; watch the listener and the channel's wake fd.
        The loop is ours before the listener is watched: an engine may attach in the
        loop's next pass, and serving it needs ``self._loop``."""
        self._loop = loop
        self._sel = sel = loop.add(self)
        sel.register(self._listener, selectors.EVENT_READ, "listener")
        if self.channel is not None:
            sel.register(self.channel.wake_fd, selectors.EVENT_READ, "wake")

    def stop(self) -> None:
        """Stop serving and close the socket (the runtime releases the memory)."""
        if self._loop is not None:
            leave_loop(self._loop, self, self._owns_loop)
        engine, self._engine = self._engine, None
        if engine is not None:
            engine[0].close()
        for pending in list(self._pending.values()):
            pending.close()
        self._pending.clear()
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # ---- on the loop (LoopSource) ---------------------------------------------------
    def ready(self, data: Any, mask: int) -> None:
        """A socket we watch is ready: the listener, the channel's wake fd, a
        connecting engine's, the attached engine's."""
        if data == "listener":
            self._accept()
        elif data == "wake":
            self._woken()
        elif isinstance(data, _Pending):
            self._pending_readable(data)
        elif data == "engine":
            if mask & selectors.EVENT_WRITE:
                self._flush()
            if mask & selectors.EVENT_READ:
                self._engine_message()

    def tick(self, now: float) -> float:
        """Refuse the connections past their deadline; due again at the nearest one
        left (a new connection pokes the loop, so none is due while none waits)."""
        self._expire(now)
        return min((p.deadline for p in self._pending.values()), default=math.inf)

    @property
    def _selector(self) -> SourceSelector:
        assert self._sel is not None, "AttachServer.start() first"
        return self._sel

    # ---- connecting engines ---------------------------------------------------------
    def _accept(self) -> None:
        """Accept every connection waiting (non-blocking); check its credentials."""
        for _ in range(LISTEN_BACKLOG):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and the like: the rest wait in the backlog
                log.warning("attach socket: accept failed: %s", exc)
                return
            conn.setblocking(False)
            try:
                cred = peer_cred(conn)
            except OSError as exc:
                log.warning("attach socket: no peer credentials (%s); closed", exc)
                conn.close()
                continue
            if cred.uid not in self.allowed:
                self._refuse_stranger(conn, cred)
            elif len(self._pending) >= MAX_PENDING:
                self._refuse_crowd(conn, cred)
            else:
                pending = _Pending(conn, cred, time.monotonic() + READ_TIMEOUT_S)
                self._pending[conn.fileno()] = pending
                self._selector.register(conn, selectors.EVENT_READ, pending)
                assert self._loop is not None
                self._loop.poke(self)  # its deadline is the loop's to keep

    def _refuse_stranger(self, conn: socket.socket, cred: PeerCred) -> None:
        """Refuse a uid that may not attach without reading anything it sent (its fds, if
        any, are released with the connection)."""
        log.warning("attach refused: peer uid %d (pid %d) is not allowed", cred.uid, cred.pid)
        self._send_now(conn, AttachReply(
            False, f"attach refused: peer uid {cred.uid} (pid {cred.pid}) is neither this "
                   f"daemon's uid {os.getuid()} nor in --attach-allow-uid", "peer_uid"))
        conn.close()

    def _refuse_crowd(self, conn: socket.socket, cred: PeerCred) -> None:
        """Refuse a connection beyond :data:`MAX_PENDING` unread (one log line per
        :data:`CROWD_LOG_S` however many)."""
        self._send_now(conn, AttachReply(
            False, f"attach refused: {MAX_PENDING} connections are already sending their "
                   f"attach messages (the daemon's limit); try again", "connections"))
        conn.close()
        self._crowd_refused += 1
        now = time.monotonic()
        if now - self._crowd_logged >= CROWD_LOG_S:
            log.warning("attach refused to pid %d (uid %d) and %d other connection(s) since "
                        "the last line: %d connections already sending attach messages "
                        "(limit %d)", cred.pid, cred.uid, self._crowd_refused - 1,
                        MAX_PENDING, MAX_PENDING)
            self._crowd_logged, self._crowd_refused = now, 0

    def _pending_readable(self, p: _Pending) -> None:
        """Read what arrived of a connecting engine's message (a few chunks at most)."""
        body = None
        try:
            for _ in range(READS_PER_EVENT):
                want = p.reader.wanted(READ_CHUNK)
                if p.first:
                    data, fds, flags, _ = socket.recv_fds(p.conn, want, MAX_FDS)
                    p.fds += fds
                    if flags & socket.MSG_CTRUNC:
                        raise AttachError(f"fds: more than {MAX_FDS} file descriptors sent "
                                          "(truncated)", "fds")
                else:
                    data = p.conn.recv(want)
                if not data:
                    raise EOFError(f"connection closed after {p.reader.progress}")
                p.first = False
                body = p.reader.feed(data)
                if body is not None:
                    break
        except BlockingIOError:
            return
        except (EOFError, OSError) as exc:
            log.info("attach from pid %d (uid %d): %s", p.cred.pid, p.cred.uid,
                     bounded(str(exc), LOG_CHARS))
            self._drop_pending(p)
            return
        except AttachError as exc:
            self._refuse_pending(p, f"unreadable attach message: {exc}", exc.field)
            return
        if body is not None:
            self._drop_pending(p, close=False)
            self._complete(p, body)

    def _expire(self, now: float) -> None:
        """Refuse the connections whose message did not arrive whole by ``now``, their
        deadline (what arrived meanwhile is read first)."""
        for p in [p for p in self._pending.values() if p.deadline <= now]:
            self._pending_readable(p)
            if p.conn.fileno() in self._pending and self._pending[p.conn.fileno()] is p:
                self._refuse_pending(
                    p, f"unreadable attach message: the message did not arrive whole "
                            f"in time ({p.reader.progress} read) (an attach message must "
                            f"arrive whole within {READ_TIMEOUT_S:g} s)")

    def _drop_pending(self, p: _Pending, *,
                      close: bool = True) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(p.conn)
        self._pending.pop(p.conn.fileno(), None)
        if close:
            p.close()

    def _refuse_pending(self, p: _Pending, error: str,
                        field: str = "") -> None:
        self._drop_pending(p, close=False)
        self._refuse(p, error, field)

    def _refuse(self, p: _Pending, error: str, field: str = "") -> None:
        """Answer a refusal (bounded), log it in one line, close the connection."""
        log.warning("attach from pid %d (uid %d) refused: %s", p.cred.pid, p.cred.uid,
                    bounded(error, LOG_CHARS))
        self._send_now(p.conn, AttachReply(False, error, field))
        p.close()

    def _complete(self, p: _Pending, body: bytes) -> None:
        """A whole attach message arrived: admit it, then attach on the executor (the
        memory's mapping and registration block); :meth:`_attached` answers. While an
        attach or a detach runs, it waits for that to end."""
        if self._busy:
            self._after_busy.append(lambda: self._complete(p, body))
            return
        if self._engine is not None:
            self._reap_closed_engine()  # may start its detach: then wait for it
            if self._busy:
                self._after_busy.append(lambda: self._complete(p, body))
                return
        try:
            req = self._admit(decode_body(body), len(p.fds))
        except RecursionError:
            self._refuse(p, "attach message nested too deeply", "")
            return
        except AttachError as exc:
            self._refuse(p, str(exc), exc.field)
            return
        fds, p.fds = p.fds, []
        self._busy = True
        loop = self._loop
        assert loop is not None

        def attach() -> None:
            try:
                outcome: str | BaseException = self._on_attach(req, fds, p.cred)  # owns fds
            except Exception as exc:
                outcome = exc
            loop.call_soon_threadsafe(lambda: self._attached(p, req, outcome))

        self._offload(attach)

    def _attached(self, p: _Pending, req: AttachRequest,
                  outcome: str | BaseException) -> None:
        """The attach ended (the instance id, or why not): answer; serve the engine."""
        cred, conn = p.cred, p.conn
        if isinstance(outcome, BaseException):
            self._idle()
            field = outcome.field if isinstance(outcome, AttachError) else ""
            if not isinstance(outcome, KvbeamError | RecursionError):
                log.error("attach from pid %d failed unexpectedly", cred.pid,
                          exc_info=outcome)
            self._refuse(p, str(outcome) if not isinstance(outcome, RecursionError)
                         else "attach message nested too deeply", field)
            return
        version = ENGINE_FRAMES_VERSION if self.channel is not None else 0
        if not self._send_now(conn, AttachReply(True, instance_id=outcome, channel=version)):
            self._detach(f"engine (pid {cred.pid}) left before the attach reply", conn,
                         answer=False)
            return
        self._idle()
        if self.channel is not None:
            self.channel.bind(conn, final_only=req.pushes == "final")
        self._plain = MessageReader()
        self._engine = (conn, cred)
        self._selector.register(conn, selectors.EVENT_READ, "engine")
        log.info("engine pid %d (uid %d) attached on %s (pushes: %s)", cred.pid, cred.uid,
                 self.path, req.pushes)

    def _idle(self) -> None:
        """The attach or detach under way ended: what waited for it goes on."""
        self._busy = False
        waiting, self._after_busy = self._after_busy, []
        for resume in waiting:
            if self._busy:  # one of them started the next attach: the rest wait again
                self._after_busy.append(resume)
            else:
                resume()

    def _admit(self, data: object, nfds: int) -> AttachRequest:
        req = request_from_json(data, nfds)
        if req.op != "attach":
            raise AttachError("op: detach without an attachment on this connection", "op")
        engine = self._engine
        if engine is not None:
            raise AttachError(f"another engine (pid {engine[1].pid}, uid {engine[1].uid}) is "
                              "attached: one engine per daemon; detach it first", "op")
        return req

    def _reap_closed_engine(self) -> None:
        """If the attached engine's socket is already closed (it closed and attached again
        at once, or another engine follows one that exited), read what it sent before
        closing and detach it now, so the new attach is not refused for a dead one."""
        engine = self._engine
        if engine is None:
            return
        poller = select.poll()
        poller.register(engine[0], select.POLLIN | _HUNG_UP)
        if not any(ev & _HUNG_UP for _, ev in poller.poll(0)):
            return
        # Closed: what is left to read is bounded (the socket's buffer), then EOF.
        for _ in range(64):
            if self._engine is None or (self.channel is not None and self.channel.paused):
                break
            self._engine_message()
        if self._engine is not None:
            self._drop_engine(f"engine (pid {engine[1].pid}) closed the attach socket",
                              answer=False)

    @staticmethod
    def _send_now(conn: socket.socket, reply: AttachReply) -> bool:
        """Send a reply without waiting (it is small and bounded: a fresh connection's
        buffer takes it whole); False when the socket did not take all of it."""
        data = frame(reply_to_json(reply))
        try:
            conn.setblocking(False)
            return conn.send(data) == len(data)
        except OSError:
            return False

    # ---- the attached engine ----------------------------------------------------------
    def _engine_message(self) -> None:
        engine = self._engine
        if engine is None:
            return
        conn, cred = engine
        reason = ""
        try:
            if self.channel is None:
                messages = self._read_plain(conn)
            else:  # frames; a JSON attach-protocol message among them is the detach
                messages = self.channel.readable(conn)
            for body in messages:
                req = request_from_json(decode_body(body), 0)
                if req.op == "detach":
                    reason = f"engine (pid {cred.pid}) detached"
                    break
                self._answer_engine(conn, AttachReply(
                    False, "op: already attached on this connection; detach first", "op"))
            if not reason:
                self._engine_events()
                return
        except (EOFError, OSError) as exc:
            reason = f"engine (pid {cred.pid}) closed the attach socket (exited?): {exc}"
        except FrameError as exc:  # an oversize frame: the stream cannot be read on
            if self.channel is not None:
                with contextlib.suppress(OSError):
                    self.channel.flush()  # its ERROR first, if the socket takes it
            reason = f"engine (pid {cred.pid}) sent an unreadable frame: {exc}"
        except (AttachError, RecursionError) as exc:
            self._answer_engine(conn, AttachReply(False, str(exc) if isinstance(
                exc, AttachError) else "attach message nested too deeply",
                getattr(exc, "field", "")))
            self._engine_events()
            return
        self._drop_engine(reason, answer=True)

    def _read_plain(self, conn: socket.socket) -> list[bytes]:
        """Without an engine channel: what arrived of the next attach-protocol message
        (the detach); the message once whole."""
        try:
            data = conn.recv(self._plain.wanted(READ_CHUNK))
        except BlockingIOError:
            return []
        if not data:
            raise EOFError("end of stream")
        body = self._plain.feed(data)
        if body is None:
            return []
        self._plain = MessageReader()
        return [body]

    def _answer_engine(self, conn: socket.socket, reply: AttachReply) -> None:
        """A reply on the attached engine's socket, in order with its pushed states."""
        if self.channel is not None:
            self.channel.push_message(frame(reply_to_json(reply)))
        else:
            self._send_now(conn, reply)

    def _drop_engine(self, reason: str, *, answer: bool) -> None:
        """End the attachment: release the memory first (on the executor), then answer
        (a detach) and close, so the engine sees its socket close only once nothing
        writes into its memory any more."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        conn = engine[0]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        if self.channel is not None:
            self.channel.unbind()
        log.warning("%s: releasing its memory", reason)
        self._detach(reason, conn, answer=answer)

    def _detach(self, reason: str, conn: socket.socket, *, answer: bool) -> None:
        """Release the memory on the executor (it fails the requests on it, telling
        their peers, and deregisters: all blocking), then answer (``answer``) and close
        ``conn``, which the loop no longer watches; attaches wait meanwhile."""
        self._busy = True
        loop = self._loop
        assert loop is not None

        def detach() -> None:
            try:
                self._on_detach(reason)
            except Exception:
                log.exception("releasing the engine's memory failed (%s)", reason)
            finally:
                if answer:
                    self._send_now(conn, AttachReply(True))
                conn.close()
                loop.call_soon_threadsafe(self._idle)

        self._offload(detach)

    def _woken(self) -> None:
        """The channel woke the loop: pushed states to write, or held frames to handle
        (the executor caught up)."""
        self._flush()
        if self._engine is not None and self.channel is not None and self.channel.paused:
            self._engine_message()  # handles the held frames first; reads on if it can

    def _flush(self) -> None:
        """Write the engine channel's pushed states; wait for writability if the socket is full."""
        engine, channel = self._engine, self.channel
        if channel is None:
            return
        try:
            channel.flush()
        except OSError as exc:
            if engine is not None:
                self._drop_engine(f"engine (pid {engine[1].pid}): {exc}; dropping it",
                                  answer=False)
            return
        self._engine_events()

    def _engine_events(self) -> None:
        """Select the engine's socket for reading unless the channel holds frames back
        (backpressure), and for writing while pushed states wait."""
        engine, channel = self._engine, self.channel
        if engine is None:
            return
        events = selectors.EVENT_READ
        if channel is not None:
            events = (0 if channel.paused else selectors.EVENT_READ) | (
                selectors.EVENT_WRITE if channel.pending_output else 0)
            if channel.can_resume:
                # The executor caught up (its wake-up may have been taken by a flush):
                # come back through the wake fd to handle the held frames.
                channel.wake()
        watched = self._selector.watched(engine[0])
        if watched is not None:
            if watched[0] != events:
                if events:
                    self._selector.modify(engine[0], events, "engine")
                else:
                    self._selector.unregister(engine[0])
            return
        if events:  # unregistered while paused with nothing to write
            self._selector.register(engine[0], events, "engine")
