"""Attach an engine's pools to its local daemon over the attach socket (SCM_RIGHTS).

:func:`attach` sends the description and the fds (:mod:`kvbeam.proto.attach_codec`)
and returns an :class:`Attachment` once the daemon mapped, checked and registered
the memory. The attachment's socket IS the attachment: :meth:`Attachment.detach`,
:meth:`Attachment.close` or the process's death detaches, and the daemon then fails
the requests on that memory and unmaps it. After the attach the same socket is the
engine's per-request channel (:attr:`Attachment.channel`, :mod:`kvbeam.engine.channel`).
No gRPC, no torch.
"""

from __future__ import annotations

import logging
import socket
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


class Attachment:
    """A live attachment; keep it (and the memory) while the daemon should serve it."""

    def __init__(self, sock: socket.socket, reply: AttachReply, path: str) -> None:
        self._sock: socket.socket | None = sock
        self.instance_id = reply.instance_id
        self.path = path
        #: The per-request channel over this socket (None: the daemon predates it).
        self.channel: EngineChannel | None = (
            EngineChannel(sock, path) if reply.channel == ENGINE_FRAMES_VERSION else None)

    @property
    def attached(self) -> bool:
        """False once detached or closed."""
        return self._sock is not None

    def detach(self, timeout: float = 30.0) -> None:
        """Detach and wait until the daemon released the memory (its requests failed)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        channel, self.channel = self.channel, None
        try:
            message = frame(request_to_json(AttachRequest(op="detach")))
            if channel is not None:  # its reader thread reads the answer
                channel.send_raw(message)
                data: object = channel.take_json(timeout)
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
        sock, self._sock = self._sock, None
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
        if sock is not None:
            sock.close()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.detach()
        else:
            self.close()


def attach(socket_path: str, pools: EnginePools | EngineBuffers,
           config: SideConfig | None = None, *, memory_kind: str = "host_shm",
           timeout: float = 60.0, pushes: str = "all") -> Attachment:
    """Hand ``pools`` to the daemon listening on ``socket_path``.

    Args:
        socket_path: the daemon's ``--attach-socket``.
        pools: an :class:`EnginePools`, or an :class:`EngineBuffers` describing the
            engine's own allocation (then ``config`` is required).
        config: the side config the memory follows (default: the pools').
        memory_kind: ``host_shm`` (memfd/tmpfs) or ``dmabuf`` (GPU memory, docs/gpu.md).
        timeout: seconds for the daemon's answer (it maps and registers the memory).
        pushes: which of its requests' state changes the daemon pushes: ``all`` (every
            one: ``poll()`` reads each state as the request passes it) or ``final``
            (Success and Failed only: ``poll()`` reads Bootstrapping until the end, and
            the channel's reader thread wakes once per request instead of three or
            four times; for a scheduler that acts only on a request's end, as vLLM's
            and sglang's do).

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
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path)
        try:
            # The fds ride with the first bytes; the rest of the message follows.
            sent = socket.send_fds(sock, [message], buffers.fds)
            sock.sendall(message[sent:])
        except OSError:
            pass  # the daemon answered early and closed (a refusal): read its answer
        data, _ = read_message(sock)
        reply = reply_from_json(data)
    except (OSError, EOFError) as exc:
        sock.close()
        raise AttachError(f"cannot attach to the daemon on {socket_path}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    if not reply.ok:
        sock.close()
        raise AttachError(f"attach refused by the daemon on {socket_path}: {reply.error}",
                          reply.field)
    sock.settimeout(None)
    log.info("attached to %s (daemon instance %s)", socket_path, reply.instance_id)
    return Attachment(sock, reply, socket_path)
