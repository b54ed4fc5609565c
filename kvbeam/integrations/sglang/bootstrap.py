"""The rendezvous sglang's bootstrap address names: a tiny key-value store over TCP.

sglang runs one bootstrap server beside each prefill server (``--disaggregation-
bootstrap-port``); prefill and decode find each other through it by
``bootstrap_room``. kvbeam's daemons do the transfer, so all that passes here is
small JSON: prefill's daemon address, and per room decode's daemon address and
destination index lists (prefill reserves at decode with them once it knows the
request's length, at its last chunk). One JSON line in, one out per connection;
served by one thread, one connection at a time (each is a dict operation). So every
read and write is bounded: a request must arrive, and its reply leave, within
:data:`REQUEST_DEADLINE_S`, and a request line is at most :data:`MAX_LINE` bytes; a
client that sends nothing, dribbles, or sends too much is answered (when it can be)
and hung up on, and the next connection is served. A ``put`` may carry ``ttl`` (seconds):
the store forgets that key then (a request's tombstone: why it ended, kept as long as the
other side may still look); ``add`` puts only when the key is absent and answers with the
value present (decode posts its room so: never over the other side's tombstone). No
sglang import.

What decode puts here decides which daemon prefill sends the request's KV to, so with
a token (the kvbeam daemons' ``--auth-token-file``) every request must carry it
(``"token"``, compared in constant time) or is refused before the store is touched;
without one the store serves loopback only, unless told it may be open (``insecure``).
The token crosses the network in clear text, as the daemons' does without TLS.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import socket
import socketserver
import threading
import time
from typing import Any

from kvbeam.auth import is_loopback, same_token
from kvbeam.errors import AuthenticationError, ConfigError

log = logging.getLogger(__name__)

#: largest request line accepted (the index lists of a 128k-token request fit easily)
MAX_LINE = 16 << 20
#: seconds a connection has to deliver its request line and take its reply: the store
#: serves one connection at a time, so this is the longest one client can hold it
REQUEST_DEADLINE_S = 5.0


def _read_line(sock: socket.socket, deadline: float, limit: int) -> bytes:
    """One ``\n``-terminated line from ``sock`` by the monotonic ``deadline``.

    Raises:
        TimeoutError: the deadline passed before the line ended.
        ConnectionError: the peer closed before the line ended (or reset).
        ValueError: the line is longer than ``limit`` bytes.
    """
    data = bytearray()
    while b"\n" not in data:
        if len(data) > limit:
            raise ValueError(f"request longer than {limit} bytes")
        late = f"no complete request within {REQUEST_DEADLINE_S:g} s"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(late)
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(1 << 20, limit + 1 - len(data)))
        except TimeoutError:
            raise TimeoutError(late) from None
        if not chunk:
            raise ConnectionError("the connection closed before the request ended")
        data += chunk
    line = bytes(data[:data.index(b"\n") + 1])
    if len(line) > limit:
        raise ValueError(f"request longer than {limit} bytes")
    return line


def _send(sock: socket.socket, deadline: float, payload: bytes) -> None:
    """Send ``payload`` by ``deadline`` (a client that does not read is not waited for)."""
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(payload)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server
    request: socket.socket

    def handle(self) -> None:
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        try:
            line = _read_line(self.request, deadline, MAX_LINE)
        except OSError as exc:  # the deadline, a hang-up, a reset
            log.warning("kvbeam bootstrap connection from %s dropped: %s",
                        self.client_address[0], exc)
            return
        except ValueError as exc:
            log.warning("kvbeam bootstrap request from %s refused: %s",
                        self.client_address[0], exc)
            self._reply(deadline, {"ok": False, "error": f"bad request: {exc}"})
            return
        try:
            req = json.loads(line)
            op, key = req["op"], str(req["key"])
            store = self.server.store
            token = self.server.token
            presented = req.get("token")
            if token and not same_token(presented, token):
                why = "no token" if not presented else "a wrong token"
                log.warning("kvbeam bootstrap request from %s refused: %s",
                            self.client_address[0], why)
                reply: dict[str, Any] = {"ok": False, "unauthenticated": True, "error": (
                    f"refused: {why}; this bootstrap store requires the kvbeam token "
                    "(KVBEAM_AUTH_TOKEN_FILE, or kvbeam_auth_token_file)")}
            elif op == "put":
                self.server.put(key, req["value"], req.get("ttl"))
                reply = {"ok": True}
            elif op == "add":  # put unless present: the present value, else None
                self.server.expire()
                present = store.get(key)
                if present is None:
                    self.server.put(key, req["value"], req.get("ttl"))
                reply = {"ok": True, "value": present}
            elif op == "get":
                self.server.expire()
                reply = {"ok": True, "value": store.get(key)}
            elif op == "delete":
                self.server.expire()
                self.server.expires.pop(key, None)
                reply = {"ok": True, "value": store.pop(key, None)}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        self._reply(deadline, reply)

    def _reply(self, deadline: float, reply: dict[str, Any]) -> None:
        try:
            _send(self.request, deadline, json.dumps(reply).encode() + b"\n")
        except OSError as exc:  # a timeout included: the client did not take its reply
            log.warning("kvbeam bootstrap reply to %s not delivered: %s",
                        self.client_address[0], exc)


class _Server(socketserver.TCPServer):
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], token: str) -> None:
        super().__init__(address, _Handler)
        self.store: dict[str, Any] = {}
        self.token = token
        #: key -> when it expires (monotonic), for keys put with a ttl
        self.expires: dict[str, float] = {}
        self._due: list[tuple[float, str]] = []  # (expiry, key), a heap; stale ones skipped

    def put(self, key: str, value: Any, ttl: Any) -> None:
        """Store ``value``; forget it after ``ttl`` seconds when given."""
        self.expire()
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                                or not math.isfinite(ttl) or ttl <= 0):
            raise ValueError(f"ttl must be a positive number of seconds (got {ttl!r})")
        self.store[key] = value
        if ttl is None:
            self.expires.pop(key, None)
            return
        self.expires[key] = when = time.monotonic() + float(ttl)
        heapq.heappush(self._due, (when, key))

    def expire(self) -> None:
        """Forget every key whose ttl ran out."""
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            when, key = heapq.heappop(self._due)
            if self.expires.get(key) == when:  # not put again since
                del self.expires[key]
                self.store.pop(key, None)
        if len(self._due) > 2 * len(self.expires) + 64:  # keys put again or deleted
            self._due = [(w, k) for k, w in self.expires.items()]
            heapq.heapify(self._due)


class BootstrapServer:
    """The store, listening on ``host:port`` (port 0: any) in a background thread.

    Args:
        token: the token every request must carry ("" : none required).
        insecure: serve a non-loopback address without a token.

    Raises:
        ConfigError: a non-loopback host without a token and without ``insecure``.
    """

    def __init__(self, host: str, port: int, *, token: str = "", insecure: bool = False) -> None:
        if not token and not insecure and not is_loopback(host):
            raise ConfigError(
                f"refusing to serve the kvbeam bootstrap store on {host} without a token: "
                "whoever reaches it decides where prefill sends KV; set "
                "KVBEAM_AUTH_TOKEN_FILE (the daemons' token file), or KVBEAM_INSECURE=true")
        if not token:
            log.warning("kvbeam sglang bootstrap store on %s:%s has NO authentication",
                        host, port)
        self._server = _Server((host, port), token)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kvbeam-sglang-bootstrap", daemon=True)
        self._thread.start()
        log.info("kvbeam sglang bootstrap server on %s", self.address)

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def call(address: str, op: str, key: str, value: Any = None, timeout: float = 10.0, *,
         token: str = "", ttl: float | None = None) -> Any:
    """One operation on the store at ``address``: ``get``, ``put``, ``delete`` or ``add``
    (put unless present); the value (``get``/``delete``: the key's; ``add``: the one
    present, None when added) or None. ``ttl``: the store forgets the put after that
    many seconds.

    Raises:
        AuthenticationError: the store requires a token and ``token`` is not it.
        RuntimeError: the store refused the request otherwise.
    """
    host, _, port = address.rpartition(":")
    request: dict[str, Any] = {"op": op, "key": key, "value": value}
    if ttl is not None:
        request["ttl"] = ttl
    if token:
        request["token"] = token
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(json.dumps(request).encode() + b"\n")
        with sock.makefile("rb") as f:
            reply = json.loads(f.readline(MAX_LINE))
    if reply.get("unauthenticated"):
        raise AuthenticationError(f"kvbeam bootstrap {address}: {reply.get('error')}",
                                  address=address)
    if not reply.get("ok"):
        raise RuntimeError(f"kvbeam bootstrap {address}: {reply.get('error')}")
    return reply.get("value")
