"""A P/D proxy written to vLLM's NixlConnector contract, for the served vLLM tests.

    python -m tests.vllm_contract_proxy --port P --prefill URL [--prefill URL ...]
        --decode URL [--decode URL ...]

Written here from the contract (docs/vllm.md, "Any proxy that speaks vLLM's contract"),
not copied from any proxy: for every ``POST /v1/completions`` or
``/v1/chat/completions`` it picks the next prefill and the next decode server (round
robin each), makes one plain uuid ``X-Request-Id`` for both, and

1. sends prefill the request with ``max_tokens`` 1 (and ``max_completion_tokens`` 1
   where given), not streamed, and NIXL's fixed ``kv_transfer_params``:
   ``do_remote_decode`` true, every other key null; whatever the client put there is
   replaced;
2. sends decode the client's request with the ``kv_transfer_params`` prefill returned,
   unchanged, and relays decode's answer (streamed or not) to the client.

It knows nothing of kvbeam. Two lines per request on stdout: ``routed ID prefill=URL
decode=URL`` before it is routed (a test finds the X-Request-Id it gave both servers)
and ``answered ID status=N``.
``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: What NixlConnector's prefill expects from a proxy: a remote decode, nothing else known.
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
    "remote_request_id": None}
PATHS = ("/v1/completions", "/v1/chat/completions")
#: Seconds a server may take to answer (a prefill behind a busy engine, a long decode).
TIMEOUT_S = 600


_SAY = threading.Lock()


def say(line: str) -> None:
    """One whole line on stdout (handler threads print at once: print() writes the text
    and its newline apart, so two lines could interleave)."""
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Picker:
    """Round robin over each list of servers (thread-safe)."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._lock = threading.Lock()

    def next(self) -> tuple[str, str]:
        with self._lock:
            return next(self._prefill), next(self._decode)


def _post(url: str, body: dict[str, Any], request_id: str) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json",
                                           "X-Request-Id": request_id})


def prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    """The client's request as prefill gets it: one token, not streamed, NIXL's params."""
    body = dict(request)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    body["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
    return body


class Handler(BaseHTTPRequestHandler):
    """One client request: prefill, then decode, answer relayed."""

    picker: Picker
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return  # one line per request, printed by do_POST

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, b"{}")
        else:
            self._answer(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        if self.path not in PATHS:
            self._answer(404, b'{"error": "not found"}')
            return
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        prefill, decode = self.picker.next()
        request_id = str(uuid.uuid4())
        # Before routing: the line is out before the client has its answer.
        say(f"routed {request_id} prefill={prefill} decode={decode}")
        status = self._route(request, prefill, decode, request_id)
        say(f"answered {request_id} status={status}")

    def _route(self, request: dict[str, Any], prefill: str, decode: str,
               request_id: str) -> int:
        try:
            with urllib.request.urlopen(_post(prefill + self.path, prefill_body(request),
                                              request_id), timeout=TIMEOUT_S) as r:
                first = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # prefill's error is the client's
            self._answer(exc.code, exc.read())
            return exc.code
        body = dict(request)
        body["kv_transfer_params"] = first.get("kv_transfer_params")
        return self._relay(decode + self.path, body, request_id)

    def _relay(self, url: str, body: dict[str, Any], request_id: str,
               first: list[float] | None = None) -> int:
        """Send decode ``body`` and relay its answer, streamed or not (``first``: when
        its first data came, appended); its status."""
        try:
            response = urllib.request.urlopen(_post(url, body, request_id), timeout=TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            self._answer(exc.code, exc.read())
            return exc.code
        with response:
            if not body.get("stream"):
                data = response.read()
                if first is not None:
                    first.append(time.monotonic())
                self._answer(response.status, data)
            else:
                self._stream(response.status, _chunks(response, first))
            return int(response.status)

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, status: int, chunks: Iterator[bytes]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


def _chunks(response: Any, first: list[float] | None = None) -> Iterator[bytes]:
    """Decode's streamed answer as it comes, a line (an SSE field or blank) at a time
    (``first``: when the first ``data:`` line came, appended)."""
    while True:
        line = response.readline()
        if not line:
            return
        if first is not None and not first and line.startswith(b"data:"):
            first.append(time.monotonic())
        yield line


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill server URL")
    ap.add_argument("--decode", action="append", required=True, help="a decode server URL")
    args = ap.parse_args(argv)
    Handler.picker = Picker([u.rstrip("/") for u in args.prefill],
                            [u.rstrip("/") for u in args.decode])
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    say(f"contract proxy on http://{args.host}:{args.port}")
    server.serve_forever()


if __name__ == "__main__":
    main()
