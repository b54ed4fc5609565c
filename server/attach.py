"""The daemon's attach socket: a local engine hands over its pools (``--pools engine``).

One long-lived thread serves a Unix stream socket (mode 0600, set before listen, or
0660 in ``--attach-group``; its directory must not be writable by others). A
connecting engine is checked by its peer credentials (SO_PEERCRED: the daemon's uid
or one of ``--attach-allow-uid``) as soon as it is accepted, before a byte of it is
read: a stranger gets a refusal and the connection closed. An allowed engine then has
:data:`READ_TIMEOUT_S` in all to send its one attach message with its memfds
(:mod:`kvbeam.proto.attach_codec`), and keeps the connection open: its lifetime is
the attachment. A detach message, the
socket closing or the engine dying ends it; the runtime then fails the requests on
that memory and unmaps it, and the next engine may attach. One engine at a time: a
second one is refused with the first one's pid.
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbeam.errors import AttachError, KvbeamError
from kvbeam.proto.attach_codec import (
    AttachReply,
    AttachRequest,
    frame,
    read_message,
    reply_to_json,
    request_from_json,
)
from kvbeam.proto.engine_frames import ENGINE_FRAMES_VERSION, FrameError
from kvbeam.threads import name_os_thread

if TYPE_CHECKING:
    from kvbeam.server.engine_channel import EngineChannel

log = logging.getLogger(__name__)

#: Seconds a connecting engine has to send its whole attach message, however it paces
#: it (the loop serves nothing else meanwhile).
READ_TIMEOUT_S = 5.0
#: How often the loop checks for stop, seconds.
TICK_S = 0.2
_CRED = struct.Struct("3i")


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
        channel: the engine channel (:mod:`kvbeam.server.engine_channel`) the attached
            socket carries after the attach reply; served by this same thread.
    """

    def __init__(self, path: str, allow_uids: Sequence[int],
                 on_attach: Callable[[AttachRequest, list[int], PeerCred], str],
                 on_detach: Callable[[str], None], *, group: str = "",
                 channel: EngineChannel | None = None) -> None:
        self.path = path
        #: The engine channel (per-request frames after the attach), None: attach only.
        self.channel = channel
        self.allowed = {os.getuid(), *allow_uids}
        self._on_attach = on_attach
        self._on_detach = on_detach
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._engine: tuple[socket.socket, PeerCred] | None = None
        _prepare_path(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            _socket_mode(path, allow_uids, group)
            self._listener.listen(4)
        except BaseException:
            self._listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def start(self) -> None:
        """Start the serving thread."""
        self._thread = threading.Thread(target=self._loop, name="kvbeam-attach", daemon=True)
        self._thread.start()
        log.info("waiting for an engine to attach on %s", self.path)

    def stop(self) -> None:
        """Stop serving and close the socket (the runtime releases the memory)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        engine, self._engine = self._engine, None
        if engine is not None:
            engine[0].close()
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # ---- the thread ---------------------------------------------------------------
    def _loop(self) -> None:
        name_os_thread()
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ, "listener")
            if self.channel is not None:
                sel.register(self.channel.wake_fd, selectors.EVENT_READ, "wake")
            while not self._stop.is_set():
                for key, mask in sel.select(TICK_S):
                    try:
                        if key.data == "listener":
                            self._accept(sel)
                        elif key.data == "wake" or mask & selectors.EVENT_WRITE:
                            self._flush(sel)
                        if key.data == "engine" and mask & selectors.EVENT_READ:
                            self._engine_message(sel)
                    except Exception:  # the attach thread must survive any one engine
                        log.exception("attach socket: handling %s failed", key.data)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        conn, _ = self._listener.accept()
        cred = peer_cred(conn)
        if cred.uid not in self.allowed:
            self._refuse_stranger(conn, cred)
            return
        conn.settimeout(READ_TIMEOUT_S)
        try:
            data, fds = read_message(conn, with_fds=True,
                                     deadline=time.monotonic() + READ_TIMEOUT_S)
            conn.settimeout(READ_TIMEOUT_S)  # not what the deadline left: for later messages
        except (EOFError, OSError, KvbeamError) as exc:
            why = (f"{exc} (an attach message must arrive whole within {READ_TIMEOUT_S:g} s)"
                   if isinstance(exc, TimeoutError) else str(exc))
            log.warning("attach from pid %d (uid %d): unreadable message: %s", cred.pid,
                        cred.uid, why)
            self._answer(conn, AttachReply(False, f"unreadable attach message: {why}"))
            conn.close()
            return
        try:
            req = self._admit(cred, data, fds)
        except AttachError as exc:
            for fd in fds:
                os.close(fd)
            self._answer(conn, AttachReply(False, str(exc), exc.field))
            conn.close()
            return
        try:
            instance = self._on_attach(req, fds, cred)  # owns (closes) the fds
        except Exception as exc:
            field = exc.field if isinstance(exc, AttachError) else ""
            if not isinstance(exc, KvbeamError):
                log.exception("attach from pid %d failed unexpectedly", cred.pid)
            log.warning("attach from pid %d (uid %d) refused: %s", cred.pid, cred.uid, exc)
            self._answer(conn, AttachReply(False, str(exc), field))
            conn.close()
            return
        version = ENGINE_FRAMES_VERSION if self.channel is not None else 0
        if not self._answer(conn, AttachReply(True, instance_id=instance, channel=version)):
            self._on_detach(f"engine (pid {cred.pid}) left before the attach reply")
            conn.close()
            return
        if self.channel is not None:
            self.channel.bind(conn, final_only=req.pushes == "final")
        self._engine = (conn, cred)
        sel.register(conn, selectors.EVENT_READ, "engine")
        log.info("engine pid %d (uid %d) attached on %s (pushes: %s)", cred.pid, cred.uid,
                 self.path, req.pushes)

    def _refuse_stranger(self, conn: socket.socket, cred: PeerCred) -> None:
        """Refuse a uid that may not attach without reading anything it sent (its fds, if
        any, are released with the connection)."""
        log.warning("attach refused: peer uid %d (pid %d) is not allowed", cred.uid, cred.pid)
        conn.setblocking(False)  # the short reply fits the socket buffer; never wait on it
        self._answer(conn, AttachReply(
            False, f"attach refused: peer uid {cred.uid} (pid {cred.pid}) is neither this "
                   f"daemon's uid {os.getuid()} nor in --attach-allow-uid", "peer_uid"))
        conn.close()

    def _admit(self, cred: PeerCred, data: object, fds: list[int]) -> AttachRequest:
        req = request_from_json(data, len(fds))
        engine = self._engine
        if engine is not None:
            raise AttachError(f"another engine (pid {engine[1].pid}, uid {engine[1].uid}) is "
                              "attached: one engine per daemon; detach it first", "op")
        if req.op != "attach":
            raise AttachError("op: detach without an attachment on this connection", "op")
        return req

    def _engine_message(self, sel: selectors.BaseSelector) -> None:
        engine = self._engine
        if engine is None:
            return
        conn, cred = engine
        reason = ""
        try:
            if self.channel is None:
                messages = [read_message(conn)[0]]
            else:  # frames; a JSON attach-protocol message among them is the detach
                messages = [json.loads(m) for m in self.channel.readable(conn)]
            for data in messages:
                req = request_from_json(data, 0)
                if req.op == "detach":
                    reason = f"engine (pid {cred.pid}) detached"
                    break
                self._answer(conn, AttachReply(False, "op: already attached on this "
                                                      "connection; detach first", "op"))
            if not reason:
                return
        except (EOFError, OSError) as exc:
            reason = f"engine (pid {cred.pid}) closed the attach socket (exited?): {exc}"
        except FrameError as exc:  # an oversize frame: the stream cannot be read on
            self._flush(sel)
            reason = f"engine (pid {cred.pid}) sent an unreadable frame: {exc}"
        except (AttachError, ValueError) as exc:
            self._answer(conn, AttachReply(False, str(exc), getattr(exc, "field", "")))
            return
        sel.unregister(conn)
        self._engine = None
        if self.channel is not None:
            self.channel.unbind()
        log.warning("%s: releasing its memory", reason)
        try:
            self._on_detach(reason)
        finally:
            self._answer(conn, AttachReply(True))
            conn.close()

    def _flush(self, sel: selectors.BaseSelector) -> None:
        """Write the engine channel's pushed states; wait for writability if the socket is full."""
        engine, channel = self._engine, self.channel
        if channel is None:
            return
        try:
            done = channel.flush()
        except OSError as exc:
            if engine is not None:
                log.warning("engine (pid %d): %s; dropping it", engine[1].pid, exc)
                engine[0].shutdown(socket.SHUT_RDWR)  # read as EOF next: the detach
            return
        if engine is not None:
            events = selectors.EVENT_READ | (0 if done else selectors.EVENT_WRITE)
            with contextlib.suppress(KeyError, ValueError):
                if sel.get_key(engine[0]).events != events:
                    sel.modify(engine[0], events, "engine")

    @staticmethod
    def _answer(conn: socket.socket, reply: AttachReply) -> bool:
        mode = conn.gettimeout()  # the engine channel runs the socket non-blocking
        try:
            conn.settimeout(READ_TIMEOUT_S)
            conn.sendall(frame(reply_to_json(reply)))
            conn.settimeout(mode)
            return True
        except OSError:
            return False
