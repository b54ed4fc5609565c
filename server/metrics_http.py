"""The /metrics endpoint, served on the daemon's loop: no thread of its own, none per scrape.

prometheus_client's ``start_http_server`` runs a server thread and starts one more thread
per scrape. A daemon's loop already waits on every socket it has, so the endpoint is one
more :class:`~kvbeam.loop.LoopSource`: the listener and each scraper's connection are
non-blocking sockets in the loop's selector. A scrape is small and rare (every 15-60 s);
its text is rendered on the loop (``generate_latest``, where the collector's reads of the
loop's state need no hand-off) and written as the socket takes it.

HTTP as a Prometheus scraper speaks it, and no more: one ``GET`` (or ``HEAD``) of
``/metrics`` (or ``/``) per connection, answered with ``Connection: close``. Anything
else is answered 404 or 405; a request head over :data:`MAX_HEAD_BYTES`, or a connection
silent for :data:`IDLE_S`, is closed. At most :data:`MAX_CONNECTIONS` are served at once
(the oldest goes first), so scrapers cannot hold the daemon's file descriptors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import selectors
import socket
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvbeam.errors import ListenError
from kvbeam.loop import DaemonLoop, SourceSelector, join_loop, leave_loop

log = logging.getLogger(__name__)

#: Longest request head read, bytes (a scraper's is a few hundred).
MAX_HEAD_BYTES = 8192
#: Scrapers' connections served at once; a new one past it closes the oldest.
MAX_CONNECTIONS = 16
#: A connection that sends or takes nothing for this long is closed, s.
IDLE_S = 10.0
#: The paths that answer the metrics.
_PATHS = frozenset({"/metrics", "/"})


@dataclass(eq=False)
class _Scrape:
    """One scraper's connection: its request head so far, then the answer going out."""

    sock: socket.socket
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the answer, from what is still to send


class MetricsEndpoint:
    """Serves ``registry`` over HTTP on the daemon's loop (the module's docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._listener: socket.socket | None = None
        self._loop: DaemonLoop | None = None
        self._own_loop = False
        self._selector: SourceSelector | None = None
        self._scrapes: dict[int, _Scrape] = {}  # by fd, oldest first (the loop's)

    def serve(self, address: str, loop: DaemonLoop | None) -> str:
        """Listen on ``HOST:PORT`` (port 0: any free port) and serve on ``loop`` (None:
        a loop of its own, a unit test's); returns the bound ``HOST:PORT``.

        Raises ListenError when the address cannot be bound (port in use, not local).
        """
        host, _, port = address.rpartition(":")
        bind = host[1:-1] if host.startswith("[") else host
        try:
            infos = socket.getaddrinfo(bind or None, int(port), type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, _kind, _proto, _, where = infos[0]
            # SO_REUSEADDR, bind and listen; the socket is closed if one of them fails.
            listener = socket.create_server(where, family=family, backlog=64)
        except (OSError, ValueError) as exc:
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ListenError(f"cannot serve metrics on {address}: {text}; "
                              "pick another --metrics port (0: any free port)") from exc
        listener.setblocking(False)
        self._listener = listener
        self._loop, self._own_loop = join_loop(loop, "kvbeam-metrics", self._join)
        return f"{host}:{listener.getsockname()[1]}"

    def _join(self, loop: DaemonLoop) -> None:
        self._selector = loop.add(self)
        assert self._listener is not None
        self._selector.register(self._listener, selectors.EVENT_READ, None)

    def stop(self) -> None:
        """Stop serving (idempotent): the listener and every connection close."""
        loop, self._loop = self._loop, None
        if loop is not None:
            leave_loop(loop, self, self._own_loop)
        for scrape in list(self._scrapes.values()):
            scrape.sock.close()
        self._scrapes.clear()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    # ---- on the loop (LoopSource) -------------------------------------------------------
    def ready(self, data: Any, mask: int) -> None:
        """The listener has connections, or a scraper's socket is ready."""
        if data is None:
            self._accept()
        elif mask & selectors.EVENT_WRITE:
            self._send(data)
        else:
            self._read(data)

    def tick(self, now: float) -> float:
        """Close the connections silent past their deadline; due again at the nearest
        deadline left (a new connection pokes the loop; one that speaks only moves its
        own deadline later, which the next tick finds)."""
        for scrape in [s for s in self._scrapes.values() if s.deadline <= now]:
            self._close(scrape)
        return min((s.deadline for s in self._scrapes.values()), default=math.inf)

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        for _ in range(MAX_CONNECTIONS):  # then the loop serves its other sockets again
            try:
                sock, _peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: this scraper is refused
                log.warning("metrics endpoint: accept failed: %s", exc)
                return
            sock.setblocking(False)
            if len(self._scrapes) >= MAX_CONNECTIONS:
                self._close(next(iter(self._scrapes.values())))
            scrape = _Scrape(sock, time.monotonic() + IDLE_S)
            self._scrapes[sock.fileno()] = scrape
            self._selector.register(sock, selectors.EVENT_READ, scrape)
            assert self._loop is not None
            self._loop.poke(self)  # its deadline is the loop's to keep

    def _read(self, scrape: _Scrape) -> None:
        try:
            data = scrape.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the scraper went before it asked
            self._close(scrape)
            return
        scrape.head += data
        end = scrape.head.find(b"\r\n\r\n")
        if end < 0:
            if len(scrape.head) > MAX_HEAD_BYTES:
                self._answer(scrape, 431, b"request head too large\n")
            return
        self._answer(scrape, *self._respond(bytes(scrape.head[:end])))

    def _respond(self, head: bytes) -> tuple[int, bytes, bool]:
        """The status, body and whether to send it (HEAD: the headers only)."""
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, b"bad request line\n", True
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, b"only GET and HEAD\n", True
        if target not in _PATHS:
            return 404, b"the metrics are at /metrics\n", method == "GET"
        try:
            body = generate_latest(self.registry)
        except Exception:  # a collector's bug: the scraper hears of it, the loop goes on
            log.exception("metrics endpoint: rendering the metrics failed")
            return 500, b"rendering the metrics failed; see the daemon's log\n", True
        return 200, body, method == "GET"

    def _answer(self, scrape: _Scrape, status: int, body: bytes, with_body: bool = True) -> None:
        reason = HTTPStatus(status).phrase
        kind = CONTENT_TYPE_LATEST if status == 200 else "text/plain; charset=utf-8"
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
        scrape.out = memoryview(head + body if with_body else head)
        scrape.deadline = time.monotonic() + IDLE_S
        assert self._selector is not None
        self._selector.modify(scrape.sock, selectors.EVENT_WRITE, scrape)
        self._send(scrape)

    def _send(self, scrape: _Scrape) -> None:
        out = scrape.out
        if out is None:
            return
        try:
            sent = scrape.sock.send(out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the scraper went: nothing more to tell it
            self._close(scrape)
            return
        scrape.out = out[sent:]
        scrape.deadline = time.monotonic() + IDLE_S
        if not scrape.out:
            self._close(scrape)

    def _close(self, scrape: _Scrape) -> None:
        fd = scrape.sock.fileno()
        if self._scrapes.get(fd) is scrape:
            del self._scrapes[fd]
            if self._selector is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(scrape.sock)
        scrape.sock.close()
