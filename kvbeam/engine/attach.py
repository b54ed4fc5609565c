"""Attach an engine's pools to its local daemon over the attach socket (SCM_RIGHTS).

:func:`attach` sends the description and the fds (:mod:`kvbeam.proto.attach_codec`)
and returns an :class:`Attachment` once the daemon mapped, checked and registered
the memory. The attachment's socket IS the attachment: :meth:`Attachment.detach`,
:meth:`Attachment.close` or the process's death detaches, and the daemon then fails
the requests on that memory and unmaps it. After the attach the same socket is the
engine's per-request channel (:attr:`Attachment.channel`, :mod:`kvbeam.engine.channel`).

With ``reattach`` (:class:`Reattach`) the attachment outlives its daemon: when the
socket closes without the engine asking (the daemon was killed or restarted), the
requests in flight fail as always, new requests fail at once (the detail says the
daemon is unreachable and that the engine is re-attaching), and one thread tries to
attach the same memory again (the attachment keeps duplicates of its fds) with
exponential backoff; once the daemon answers, :attr:`Attachment.channel` is a new
channel and requests move again. No gRPC, no torch.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType

from kvbeam.engine.channel import EngineChannel
from kvbeam.engine.memory import EngineBuffers, EnginePools
from kvbeam.errors import AttachError
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.attach_codec import (
    AttachReply,
    AttachRequest,
    frame,
    push_mode,
    read_message,
    reply_from_json,
    request_to_json,
)
from kvbeam.proto.engine_frames import ENGINE_FRAMES_VERSION

log = logging.getLogger(__name__)

#: Seconds between connect tries while the daemon's listen backlog is full (EAGAIN).
CONNECT_RETRY_S = (0.005, 0.1)


@dataclass(frozen=True)
class Reattach:
    """How an :class:`Attachment` attaches again after its daemon went away.

    Tries come ``first_delay_s`` after the loss, then each twice as long after the last
    (at most ``max_delay_s``); each try waits up to ``timeout_s`` for the daemon's
    answer. ``max_tries`` 0 tries until the attachment is closed; otherwise the
    attachment gives up after that many (new requests then fail saying so).
    """

    first_delay_s: float = 0.1
    max_delay_s: float = 5.0
    timeout_s: float = 60.0
    max_tries: int = 0

    def waits(self) -> Iterator[float]:
        """The wait before each try: ``first_delay_s``, doubling, at most ``max_delay_s``;
        ``max_tries`` of them (endless when 0)."""
        delay, tries = self.first_delay_s, 0
        while not self.max_tries or tries < self.max_tries:
            yield delay
            tries += 1
            delay = min(delay * 2, self.max_delay_s)


class Attachment:
    """A live attachment; keep it (and the memory) while the daemon should serve it.

    :attr:`channel` is the current engine channel: read it for each request (a
    :class:`~kvbeam.engine.Sender`/:class:`~kvbeam.engine.Receiver` given the
    attachment does), never keep it, since a re-attach replaces it.
    """

    def __init__(self, sock: socket.socket, reply: AttachReply, path: str, *,
                 message: bytes = b"", fds: list[int] | None = None,
                 reattach: Reattach | None = None) -> None:
        # One lock for the socket, the channel and the re-attach thread: the reader
        # thread's close callback and close()/detach() meet here.
        self._lock = threading.Lock()
        self._sock: socket.socket | None = sock
        self.instance_id = reply.instance_id
        self.path = path
        self._message = message
        self._fds = fds or []  # duplicates of the attached fds (re-attach only)
        self._policy = reattach
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        #: Times this attachment attached again after its daemon went away.
        self.reattaches = 0
        #: The per-request channel over this socket (None: the daemon predates it).
        self.channel: EngineChannel | None = self._channel(sock, reply)
        if reattach is not None and self.channel is None:
            log.warning("the daemon on %s has no engine channel: this attachment cannot "
                        "re-attach", path)

    def _channel(self, sock: socket.socket, reply: AttachReply) -> EngineChannel | None:
        if reply.channel != ENGINE_FRAMES_VERSION:
            if reply.channel:
                log.warning("the daemon on %s speaks engine frames version %d, this kvbeam "
                            "%d: no engine channel (requests cannot be sent over this "
                            "attachment); run the same kvbeam in the engine and the daemon",
                            self.path, reply.channel, ENGINE_FRAMES_VERSION)
            return None
        if self._policy is None:
            return EngineChannel(sock, self.path)
        return EngineChannel(sock, self.path, on_closed=self._lost,
                             closed_note="; the daemon is unreachable: re-attaching")

    @property
    def attached(self) -> bool:
        """True while the daemon serves this attachment (False once detached or closed,
        and while re-attaching)."""
        channel = self.channel
        return self._sock is not None and (channel is None or not channel.closed_reason)

    @property
    def reattaching(self) -> bool:
        """True while the attachment tries to attach again (its daemon went away)."""
        return self._thread is not None

    def detach(self, timeout: float = 30.0) -> None:
        """Detach and wait until the daemon released the memory (its requests failed).
        While re-attaching, stops that (nothing is attached)."""
        self._stop()
        with self._lock:
            sock, self._sock = self._sock, None
            channel, self.channel = self.channel, None
        if sock is None or (channel is not None and channel.closed_reason):
            if channel is not None:
                channel.close()
            if sock is not None:
                sock.close()
            return
        try:
            message = frame(request_to_json(AttachRequest(op="detach")))
            if channel is not None:  # its reader thread reads the answer
                channel.send_raw(message)
                try:
                    data: object = channel.take_json(timeout)
                except EOFError:
                    if not channel.closed_reason:
                        raise
                    # Closed without the answer (it did not fit a full socket): the
                    # daemon closes an engine's socket only once it released the memory.
                    log.info("detached from %s (the socket closed before the answer)",
                             self.path)
                    return
            else:
                sock.settimeout(timeout)
                sock.sendall(message)
                data, _ = read_message(sock)
            reply = reply_from_json(data)
            if not reply.ok:
                raise AttachError(f"detach refused by {self.path}: {reply.error}", reply.field)
        except (OSError, EOFError) as exc:
            raise AttachError(f"detach from {self.path} failed: {exc}") from None
        finally:
            if channel is not None:
                channel.close()
            sock.close()

    def close(self) -> None:
        """Drop the attachment without waiting (the daemon detaches when it sees EOF)."""
        self._stop()
        with self._lock:
            sock, self._sock = self._sock, None
            channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
        if sock is not None:
            sock.close()

    def _stop(self) -> None:
        """No more re-attaching: the thread (if any) stops at its next step and closes
        the fd duplicates itself (it may be sending them); else they are closed now."""
        self._stopped.set()
        with self._lock:
            if self._thread is not None:
                return
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    # ---- re-attach ------------------------------------------------------------------
    def _lost(self, reason: str) -> None:
        """The channel closed (any thread): unless the engine closed it, re-attach."""
        with self._lock:
            if self._stopped.is_set() or self._thread is not None or self._policy is None:
                return
            sock, self._sock = self._sock, None
            self._thread = threading.Thread(target=self._reattach, args=(reason,),
                                            name="kvbeam-reattach", daemon=True)
            self._thread.start()
        if sock is not None:
            sock.close()

    def _reattach(self, reason: str) -> None:
        """Attach the same memory again, with backoff, until it works, the policy gives
        up or the engine closes the attachment."""
        policy = self._policy
        assert policy is not None
        log.warning("the daemon on %s went away (%s): re-attaching the same memory; new "
                    "requests fail at once until then", self.path, reason)
        gone = f"the daemon on {self.path} is unreachable ({reason})"
        self._note(f"{gone}; re-attaching")
        tries, last = 0, ""
        try:
            for wait in policy.waits():
                if self._stopped.wait(wait):
                    return
                tries += 1
                try:
                    sock, reply = _attach_once(self.path, self._message, self._fds,
                                               policy.timeout_s)
                except AttachError as exc:
                    why = str(exc)
                    (log.warning if why != last else log.info)(
                        "re-attach to %s, try %d: %s", self.path, tries, why)
                    last = why
                    self._note(f"{gone}; re-attaching (try {tries}: {why})")
                    continue
                with self._lock:
                    if self._stopped.is_set():
                        sock.close()
                        return
                    self._thread = None  # first: the new channel's loss starts anew
                    self.channel = self._channel(sock, reply)
                    self._sock = sock
                    self.instance_id = reply.instance_id
                    self.reattaches += 1  # last: who waits for it sees the rest
                log.warning("re-attached to %s after %d tr%s (daemon instance %s)", self.path,
                            tries, "y" if tries == 1 else "ies", reply.instance_id)
                return
            self._note(f"{gone}; gave up re-attaching after {tries} tries (last: {last})")
            log.error("gave up re-attaching to %s after %d tries: %s", self.path, tries, last)
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None
                fds = self._fds if self._stopped.is_set() else []
                if fds:
                    self._fds = []
            for fd in fds:  # the engine closed the attachment meanwhile: ours to close
                os.close(fd)

    def _note(self, reason: str) -> None:
        channel = self.channel
        if channel is not None:
            channel.note_closed(reason)

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.detach()
        else:
            self.close()


def _connect(path: str, deadline: float) -> socket.socket:
    """A connected socket; retries while the daemon's listen backlog is full (a Unix
    socket's connect then fails at once with EAGAIN) until ``deadline``."""
    pause = CONNECT_RETRY_S[0]
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise
        except BaseException:
            sock.close()
            raise
        time.sleep(pause)
        pause = min(pause * 2, CONNECT_RETRY_S[1])


def _attach_once(path: str, message: bytes, fds: list[int], timeout: float
                 ) -> tuple[socket.socket, AttachReply]:
    """Connect, send the attach message with the fds, read the answer; a refusal for a
    crowd of other connections (``connections``: the daemon's cap on attach messages
    arriving at once) is tried again until ``timeout``.

    Raises:
        AttachError: refused (``field`` set), or the daemon cannot be reached.
    """
    deadline = time.monotonic() + timeout
    pause = CONNECT_RETRY_S[0]
    while True:
        try:
            return _attach_try(path, message, fds, deadline)
        except AttachError as exc:
            if exc.field != "connections" or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, CONNECT_RETRY_S[1])


def _attach_try(path: str, message: bytes, fds: list[int], deadline: float
                ) -> tuple[socket.socket, AttachReply]:
    try:
        sock = _connect(path, deadline)
    except OSError as exc:
        raise AttachError(f"cannot attach to the daemon on {path}: {exc}") from None
    try:
        try:
            # The fds ride with the first bytes; the rest of the message follows.
            sent = socket.send_fds(sock, [message], fds)
            sock.sendall(message[sent:])
        except OSError:
            pass  # the daemon answered early and closed (a refusal): read its answer
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        data, _ = read_message(sock)
        reply = reply_from_json(data)
    except (OSError, EOFError) as exc:
        sock.close()
        raise AttachError(f"cannot attach to the daemon on {path}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    if not reply.ok:
        sock.close()
        raise AttachError(f"attach refused by the daemon on {path}: {reply.error}",
                          reply.field)
    sock.settimeout(None)
    return sock, reply


def attach(socket_path: str, pools: EnginePools | EngineBuffers,
           config: SideConfig | None = None, *, memory_kind: str = "host_shm",
           timeout: float = 60.0, pushes: str = "all",
           reattach: Reattach | bool = False) -> Attachment:
    """Hand ``pools`` to the daemon listening on ``socket_path``.

    Args:
        socket_path: the daemon's ``--attach-socket``.
        pools: an :class:`EnginePools`, or an :class:`EngineBuffers` describing the
            engine's own allocation (then ``config`` is required).
        config: the side config the memory follows (default: the pools').
        memory_kind: ``host_shm`` (memfd/tmpfs) or ``dmabuf`` (GPU memory, docs/gpu.md).
        timeout: seconds for the daemon's answer (it maps and registers the memory),
            connect included (a full listen backlog is retried until then).
        pushes: which of its requests' state changes the daemon pushes: ``all`` (every
            one: ``poll()`` reads each state as the request passes it) or ``final``
            (Success and Failed only: ``poll()`` reads Bootstrapping until the end, and
            the channel's reader thread wakes once per request instead of three or
            four times; for a scheduler that acts only on a request's end, as vLLM's
            and sglang's do).
        reattach: attach the same memory again when the daemon goes away (killed,
            restarted): True for the default :class:`Reattach`, or a policy. The
            attachment keeps duplicates of the fds until it is closed; the memory must
            stay as it is (it does: memfds are sealed against resizing).

    Raises:
        AttachError: the daemon refused (the message and ``field`` say why), or it
            cannot be reached.
    """
    if isinstance(pools, EnginePools):
        config = config or pools.config
        buffers = pools.buffers()
    else:
        buffers = pools
    if config is None:
        raise AttachError("attach: the side config is required with EngineBuffers", "config")
    req = AttachRequest(op="attach", memory_kind=memory_kind, config=config,
                        components=tuple(tuple(c) for c in buffers.components),
                        pushes=push_mode(pushes))
    message = frame(request_to_json(req))
    sock, reply = _attach_once(socket_path, message, buffers.fds, timeout)
    log.info("attached to %s (daemon instance %s)", socket_path, reply.instance_id)
    policy = (Reattach() if reattach is True else reattach) or None
    fds = [os.dup(fd) for fd in buffers.fds] if policy is not None else []
    return Attachment(sock, reply, socket_path, message=message, fds=fds, reattach=policy)
