"""The tests' contract proxy (tests/vllm_contract_proxy.py) against two stand-in servers.

What the served tests rely on: prefill gets NIXL's fixed kv_transfer_params (the
client's replaced), ``max_tokens`` 1 and no stream; both servers get the same plain
uuid X-Request-Id; decode gets the client's request with exactly what prefill returned;
decode's answer, streamed or not, reaches the client; round robin over each list.
"""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests import vllm_contract_proxy as proxy

STREAM = b'data: {"n": 1}\n\ndata: [DONE]\n'


class _Server:
    """A stand-in vLLM server: records each request (its body and X-Request-Id)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.seen: list[tuple[str, dict[str, Any]]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.seen.append((self.headers["X-Request-Id"], body))
                if outer.role == "prefill":
                    self._send(json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {
                        "do_remote_prefill": True, "kvbeam_id": f"t-{len(outer.seen)}",
                        "nested": {"a": [1, 2]}}}).encode())
                elif body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Content-Length", str(len(STREAM)))
                    self.end_headers()
                    self.wfile.write(STREAM)
                else:
                    self._send(json.dumps({"choices": [{"text": "decoded"}]}).encode())

            def _send(self, data: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_port}"


@pytest.fixture
def proxied() -> Iterator[tuple[str, list[_Server], list[_Server]]]:
    prefills, decodes = [_Server("prefill"), _Server("prefill")], [_Server("decode")]
    proxy.Handler.picker = proxy.Picker([s.url for s in prefills], [s.url for s in decodes])
    http = ThreadingHTTPServer(("127.0.0.1", 0), proxy.Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_port}", prefills, decodes
    for s in (http, *(p.http for p in prefills), *(d.http for d in decodes)):
        s.shutdown()


def _post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return bytes(r.read())


def test_prefill_gets_nixls_params_and_decode_what_prefill_returned(
        proxied: tuple[str, list[_Server], list[_Server]]) -> None:
    url, prefills, decodes = proxied
    client = {"prompt": [1, 2, 3], "max_tokens": 8, "stream": False,
              "kv_transfer_params": {"kvbeam_id": "the client's", "decode_daemon": "x:1"}}
    assert json.loads(_post(url, client)) == {"choices": [{"text": "decoded"}]}
    assert _post(url, {**client, "stream": True}) == STREAM
    # Round robin: one request to each prefill.
    (p_id, p_body), = prefills[0].seen
    assert p_body["kv_transfer_params"] == proxy.NIXL_PREFILL_PARAMS  # the client's replaced
    assert (p_body["max_tokens"], p_body["stream"], p_body["prompt"]) == (1, False, [1, 2, 3])
    (d_id, d_body), second = decodes[0].seen
    assert d_id == p_id and str(uuid.UUID(p_id)) == p_id  # one plain uuid for both
    assert d_body["kv_transfer_params"] == {"do_remote_prefill": True, "kvbeam_id": "t-1",
                                            "nested": {"a": [1, 2]}}
    assert d_body["max_tokens"] == 8 and d_body["prompt"] == [1, 2, 3]
    (p2_id, p2_body), = prefills[1].seen
    assert second[0] == p2_id != p_id and p2_body["stream"] is False
    assert second[1]["stream"] is True
