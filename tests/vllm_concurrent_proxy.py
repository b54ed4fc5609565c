"""A P/D proxy that sends each request to prefill and decode at once, naming both daemons.

    python -m tests.vllm_concurrent_proxy --port P --prefill URL=DAEMON --decode URL=DAEMON

What layer-by-layer sends need to shorten the time to first token: decode reserves
the request's blocks while prefill computes it, so prefill's daemon writes each layer
as vLLM computes it (docs/vllm.md, "Layer by layer"). Behind vllm-router or a proxy of
vLLM's contract, decode hears of the request only once prefill returned, and every
layer waits for that. For every ``POST /v1/completions`` or ``/v1/chat/completions``
it picks the next prefill and decode (round robin each) and a transfer name, then at
once

- sends prefill the request with ``max_tokens`` 1, not streamed, and
  ``kv_transfer_params`` ``{"do_remote_decode": true, "kvbeam_id": NAME,
  "decode_daemon": DECODE_DAEMON}`` (its answer is only logged);
- sends decode the client's request with ``{"do_remote_prefill": true, "kvbeam_id":
  NAME, "prefill_daemon": PREFILL_DAEMON}``, and relays decode's answer.

A client's ``kv_transfer_params.kvbeam_id`` names the transfer (a test's negative
control), else it is the request's uuid; its ``kvbeam_name_decode`` false leaves decode
unnamed to prefill (the send then goes whole, to the decode that reserves it: the
benchmark's reference). Output lines as tests/vllm_contract_proxy.py's, plus ``prefill ID
status=N`` and ``timing ID prefill_ms=P decode_first_ms=D`` (from the request's arrival:
prefill's answer, decode's first bytes; tests/bench/vllm_layerwise.py reads them).
"""

from __future__ import annotations

import argparse
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.server import ThreadingHTTPServer
from typing import Any

from tests.vllm_contract_proxy import TIMEOUT_S, Handler, Picker, _post, prefill_body, say


class ConcurrentHandler(Handler):
    """One client request: prefill and decode at once, decode's answer relayed."""

    daemons: dict[str, str]  # server URL -> its kvbeam daemon

    def _route(self, request: dict[str, Any], prefill: str, decode: str,
               request_id: str) -> int:
        began = time.monotonic()
        asked = request.get("kv_transfer_params") or {}
        name = str(asked.get("kvbeam_id") or request_id)
        first = prefill_body(request)
        first["kv_transfer_params"] = {"do_remote_decode": True, "kvbeam_id": name}
        if asked.get("kvbeam_name_decode", True):
            first["kv_transfer_params"]["decode_daemon"] = self.daemons[decode]
        answered: list[float] = []
        prefilled = threading.Thread(target=self._prefill, daemon=True, args=(
            prefill + self.path, first, request_id, answered))
        prefilled.start()
        body = dict(request)
        body["kv_transfer_params"] = {"do_remote_prefill": True, "kvbeam_id": name,
                                      "prefill_daemon": self.daemons[prefill]}
        first_bytes: list[float] = []
        status = self._relay(decode + self.path, body, request_id, first_bytes)
        prefilled.join(TIMEOUT_S)
        if answered and first_bytes:
            say(f"timing {request_id} prefill_ms={1000 * (answered[0] - began):.1f} "
                f"decode_first_ms={1000 * (first_bytes[0] - began):.1f}")
        return status

    def _prefill(self, url: str, body: dict[str, Any], request_id: str,
                 answered: list[float]) -> None:
        try:
            with urllib.request.urlopen(_post(url, body, request_id), timeout=TIMEOUT_S) as r:
                r.read()
                status = int(r.status)
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError as exc:
            say(f"prefill {request_id} error={exc}")
            return
        answered.append(time.monotonic())
        say(f"prefill {request_id} status={status}")


def _pairs(values: Sequence[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        url, sep, daemon = value.partition("=")
        if not sep or not daemon:
            raise SystemExit(f"{flag} {value!r}: URL=DAEMON is needed")
        out[url.rstrip("/")] = daemon
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", action="append", required=True,
                    help="a prefill server URL=its kvbeam daemon's host:port")
    ap.add_argument("--decode", action="append", required=True,
                    help="a decode server URL=its kvbeam daemon's host:port")
    args = ap.parse_args(argv)
    prefill, decode = _pairs(args.prefill, "--prefill"), _pairs(args.decode, "--decode")
    ConcurrentHandler.daemons = {**prefill, **decode}
    ConcurrentHandler.picker = Picker(list(prefill), list(decode))
    server = ThreadingHTTPServer((args.host, args.port), ConcurrentHandler)
    server.daemon_threads = True
    say(f"concurrent proxy on http://{args.host}:{args.port}")
    server.serve_forever()


if __name__ == "__main__":
    main()
