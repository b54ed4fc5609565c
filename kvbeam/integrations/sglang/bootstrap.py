"""The rendezvous sglang's bootstrap address names: a tiny key-value store over TCP.

sglang runs one bootstrap server beside each prefill server (``--disaggregation-
bootstrap-port``); prefill and decode find each other through it by
``bootstrap_room``. kvbeam's daemons do the transfer, so all that passes here is
small JSON: prefill's daemon address, and per room decode's daemon address and
destination index lists (prefill reserves at decode with them once it knows the
request's length, at its last chunk). One JSON line in, one out per connection;
served by one thread, one connection at a time (each is a dict operation).
No sglang import.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from typing import Any

log = logging.getLogger(__name__)

#: largest request line accepted (the index lists of a 128k-token request fit easily)
MAX_LINE = 16 << 20


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        line = self.rfile.readline(MAX_LINE)
        try:
            req = json.loads(line)
            op, key = req["op"], str(req["key"])
            store = self.server.store
            if op == "put":
                store[key] = req["value"]
                reply: dict[str, Any] = {"ok": True}
            elif op == "get":
                reply = {"ok": True, "value": store.get(key)}
            elif op == "delete":
                reply = {"ok": True, "value": store.pop(key, None)}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        self.wfile.write(json.dumps(reply).encode() + b"\n")


class _Server(socketserver.TCPServer):
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self.store: dict[str, Any] = {}


class BootstrapServer:
    """The store, listening on ``host:port`` (port 0: any) in a background thread."""

    def __init__(self, host: str, port: int) -> None:
        self._server = _Server((host, port))
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


def call(address: str, op: str, key: str, value: Any = None, timeout: float = 10.0) -> Any:
    """One operation on the store at ``address``; the value (``get``/``delete``) or None."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(json.dumps({"op": op, "key": key, "value": value}).encode() + b"\n")
        with sock.makefile("rb") as f:
            reply = json.loads(f.readline(MAX_LINE))
    if not reply.get("ok"):
        raise RuntimeError(f"kvbeam bootstrap {address}: {reply.get('error')}")
    return reply.get("value")
