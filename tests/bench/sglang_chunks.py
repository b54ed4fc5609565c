"""`make bench-sglang-chunks`: what sending each prefill chunk as sglang hands it over saves.

sglang 0.5.23 hands its transfer backend a request's pages chunk by chunk
(``KVSender.send`` after each chunk's forward) and reports no layer progress, so
kvbeam's backend streams per chunk (docs/sglang.md, "Chunk by chunk"). This bench runs
sglang's own servers with ``--disaggregation-transfer-backend kvbeam``, started as
tests/host/test_sglang_server.py starts them (tests/sglang_server_helpers.py; the
daemons ``--pools engine`` over TCP on loopback), with chunked prefill on
(``--chunk``, well below the prompts):

- two prefill servers, each with its own daemon and bootstrap port: one streaming
  (``KVBEAM_STREAM_CHUNKS`` unset: on), one sending whole (``KVBEAM_STREAM_CHUNKS=0``:
  one SEND at the last chunk), both in front of the same decode server and daemon;
- a plain sglang server (no disaggregation) as the reference.

Every server runs with ``--sleep-on-idle`` (docs/sglang.md: an idle sglang scheduler
otherwise polls a core) and they run side by side, so the two ways alternate request by
request under the same load. Each request goes to prefill and decode at once, as
sglang's routers send it (the mini load balancer's ``asyncio.gather`` of both POSTs,
the Rust PD router's ``execute_dual_dispatch``); in any order, sglang's prefill keeps a
request in its bootstrap queue until decode reserved (the default
``--disaggregation-decode-allocation-policy early``), so decode has reserved before
prefill computes and every streamed chunk has somewhere to land. The bench sends the
two POSTs itself, with the fields the router adds (``bootstrap_host``, ``_port``,
``_room``), because it needs both answers: prefill's
``meta_info.prefill_finished_time`` (``--enable-metrics``: sglang's own stamp when the
last chunk's forward was sampled, just before it hands the last chunk to the backend)
and decode's streamed first token. Per request:

- ``post_prefill_critical_path_ms``: prefill's end (that stamp) to decode's first
  token at the client: what the transfer still costs after the prompt was computed;
- TTFT at the client (decode's first token), and the plain server's; in the JSON also
  prefill's answer (it answers once its daemon reported Success).

Prompts are fresh random ids (no prefix hits), one request at a time. The model is a
seeded random Llama, deep and narrow like the vLLM bench's (``--layers``, float32 KV:
``--kv-heads`` x ``--head-dim`` per token and layer, K and V), so that a prompt's KV is
not trivial to move while its forward stays short on 2 CPU cores. Before measuring, one
prompt goes through both pairs and the plain server, and the outputs must be equal.
Figures only; no thresholds. Runs in the sglang server venv (``make sglang-env``).

    python -m tests.bench.sglang_chunks [--lengths 512,2048,4096] [--requests N]
        [--chunk N] [--layers N] [--json PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from tests.sglang_server_helpers import (
    TINY_LLAMA,
    Process,
    daemon,
    free_port,
    post_generate,
    sglang_server,
    write_model,
)

WAYS = ("chunks", "whole")
#: The daemons' deadlines, long: sent whole, nothing reaches decode's reservation before
#: the prompt's end, and a long prompt's forward here outlasts the default 10 s of
#: ``--deadline-bootstrap-s`` (measured: an 8k-token prompt failed with "timeout: no
#: progress in Bootstrapping for 10.0 s").
DEADLINES = ("--deadline-bootstrap-s", "600", "--deadline-waiting-s", "600",
             "--send-wait-s", "600")
MODEL_NAME = "bench-llama"
#: The first output token the check compares (and the requests generate).
NEW_TOKENS = 4


def model_config(layers: int, kv_heads: int, head_dim: int, max_len: int) -> dict[str, Any]:
    """A Llama of ``layers`` layers whose KV per token and layer is K and V of
    ``kv_heads`` x ``head_dim`` (narrow otherwise: the prompt's compute stays small
    beside its KV)."""
    return {**TINY_LLAMA, "num_hidden_layers": layers, "num_attention_heads": kv_heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hidden_size": kv_heads * head_dim, "intermediate_size": 2 * kv_heads * head_dim,
            "max_position_embeddings": max_len}


def _post(port: int, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    return post_generate(port, body, timeout)


def _stream(port: int, body: dict[str, Any], timeout: float = 600.0
            ) -> tuple[float | None, list[int], str]:
    """POST /generate streamed: (when the first chunk with output ids arrived, the last
    chunk's output ids, an error or "")."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate",
                                 json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    first: float | None = None
    ids: list[int] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return first, ids, json.dumps(chunk)[:500]
                got = chunk.get("output_ids") or []
                if got and first is None:
                    first = time.time()
                ids = got
    except urllib.error.HTTPError as exc:
        return first, ids, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}"
    return first, ids, ""


def _sampling() -> dict[str, Any]:
    return {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def pd_request(prefill_port: int, bootstrap_port: int, decode_port: int,
               ids: list[int]) -> dict[str, Any]:
    """One request to prefill and decode at once, as sglang's router sends it; the
    timings (seconds since the epoch) and decode's output ids.

    Raises:
        RuntimeError: either side answered with an error.
    """
    body = {"input_ids": ids, "sampling_params": _sampling(),
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    answers: dict[str, Any] = {}

    def prefill() -> None:
        answers["prefill"] = _post(prefill_port, body)
        answers["prefill_at"] = time.time()

    worker = threading.Thread(target=prefill)
    sent = time.time()
    worker.start()
    first, out, error = _stream(decode_port, body)
    worker.join(600)
    meta = answers.get("prefill", {}).get("meta_info", {})
    if error or first is None or "prefill_finished_time" not in meta:
        raise RuntimeError(f"room {body['bootstrap_room']}: decode {error or out}; prefill "
                           f"{json.dumps(answers.get('prefill'))[:600]}")
    return {"room": body["bootstrap_room"], "sent": sent,
            "prefill_finished": float(meta["prefill_finished_time"]),
            "prefill_answered": answers["prefill_at"], "first_token": first,
            "output_ids": out}


def plain_request(port: int, ids: list[int]) -> tuple[float, list[int]]:
    """TTFT (s) and output ids of one request to the plain server."""
    sent = time.time()
    first, out, error = _stream(port, {"input_ids": ids, "sampling_params": _sampling()})
    if error or first is None:
        raise RuntimeError(f"plain server: {error or out}")
    return first - sent, out


class Bench:
    """The daemons and servers of one run (started in order, stopped in reverse)."""

    def __init__(self, work: Path, model: str, chunk: int, max_tokens: int,
                 log_requests: bool = False) -> None:
        self.work, self.model, self.log_requests = work, model, log_requests
        self.procs: dict[str, Process] = {}
        self.ports = {k: free_port() for k in (
            "chunks daemon", "whole daemon", "decode daemon", "chunks", "whole", "decode",
            "plain", "chunks boot", "whole boot")}
        self.flags = ("--max-total-tokens", str(max_tokens), "--chunked-prefill-size",
                      str(chunk), "--served-model-name", MODEL_NAME, "--dtype", "float32",
                      "--sleep-on-idle")
        self.starts: dict[str, float] = {}

    def _server(self, name: str, port: int, *flags: str, env: dict[str, str] | None = None
                ) -> None:
        t0 = time.monotonic()
        p = self.procs[name] = sglang_server(name, self.model, port, self.work / f"{name}.log",
                                             *self.flags, *flags, env=env)
        p.wait_for("The server is fired up")
        self.starts[name] = time.monotonic() - t0
        print(f"{name} server up in {self.starts[name]:.0f} s", flush=True)

    def start(self) -> None:
        ports, work = self.ports, self.work
        for role, name in (("prefill", "chunks"), ("prefill", "whole"), ("decode", "decode")):
            extra = DEADLINES + (("--log-requests",) if self.log_requests else ())
            self.procs[f"{name} daemon"] = daemon(
                role, f"127.0.0.1:{ports[f'{name} daemon']}", work / f"{name}.sock",
                work / f"{name}-daemon.log", name=f"kvbeam {role} ({name})", extra=extra)
        for name, stream in (("chunks", None), ("whole", "0")):
            env = {"KVBEAM_DAEMON": f"127.0.0.1:{ports[f'{name} daemon']}",
                   "KVBEAM_ATTACH_SOCKET": str(work / f"{name}.sock")}
            if stream is not None:
                env["KVBEAM_STREAM_CHUNKS"] = stream
            self._server(name, ports[name], "--disaggregation-mode", "prefill",
                         "--disaggregation-transfer-backend", "kvbeam",
                         "--disaggregation-bootstrap-port", str(ports[f"{name} boot"]),
                         "--enable-metrics", env=env)
        # One decode server for both prefill servers (each request names its prefill's
        # bootstrap port); its --disaggregation-bootstrap-port is unused on decode.
        self._server("decode", ports["decode"], "--disaggregation-mode", "decode",
                     "--disaggregation-transfer-backend", "kvbeam",
                     "--disaggregation-bootstrap-port", str(ports["chunks boot"]),
                     "--disaggregation-decode-retraction-backup", "none",
                     env={"KVBEAM_DAEMON": f"127.0.0.1:{ports['decode daemon']}",
                          "KVBEAM_ATTACH_SOCKET": str(work / "decode.sock")})
        self._server("plain", ports["plain"])
        for name in ("chunks", "whole"):
            logged = self.procs[name].text()
            want = "sent as sglang hands it over" if name == "chunks" else \
                "sent whole, at its last chunk (KVBEAM_STREAM_CHUNKS off)"
            if want not in logged:
                raise RuntimeError(f"the {name} prefill server did not log {want!r}")

    def request(self, way: str, ids: list[int]) -> dict[str, Any]:
        return pd_request(self.ports[way], self.ports[f"{way} boot"], self.ports["decode"], ids)

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()


def measure(bench: Bench, rng: np.random.Generator, length: int, requests: int
            ) -> dict[str, Any]:
    """One prompt length: the two ways in turn, ``requests`` times each, fresh prompts;
    then the plain server."""
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for _ in range(requests):
        for way in WAYS:
            r = bench.request(way, [int(t) for t in rng.integers(3, 1000, length)])
            runs[way].append({
                "room": r["room"], "sent": r["sent"], "prefill_finished": r["prefill_finished"],
                "first_token": r["first_token"],
                "post_prefill_critical_path_ms": 1e3 * (r["first_token"] - r["prefill_finished"]),
                "ttft_ms": 1e3 * (r["first_token"] - r["sent"]),
                "prefill_ms": 1e3 * (r["prefill_finished"] - r["sent"]),
                "prefill_answered_ms": 1e3 * (r["prefill_answered"] - r["prefill_finished"])})
    out: dict[str, Any] = {"prompt": length}
    for way in WAYS:
        out[way] = {k: statistics.median(run[k] for run in runs[way]) for k in runs[way][0]
                    if k.endswith("_ms")}
        out[way]["runs"] = runs[way]
    plain = [plain_request(bench.ports["plain"],
                           [int(t) for t in rng.integers(3, 1000, length)])[0]
             for _ in range(requests)]
    out["plain_ttft_ms"] = 1e3 * statistics.median(plain)
    return out


def label(length: int) -> str:
    return f"{length // 1024}k" if length >= 1024 and length % 1024 == 0 else str(length)


def report(rows: list[dict[str, Any]], chunk: int, layers: int, kv_per_token: int,
           requests: int) -> str:
    lines = [f"model: {layers} layers, {kv_per_token:,} KV bytes per token (all layers), "
             f"float32; --chunked-prefill-size {chunk}; TCP on loopback; medians of "
             f"{requests} requests per length and way",
             "| prompt | chunks | KV bytes | way | prefill's end -> decode's first token | "
             "TTFT | prefill (sent -> its end) | plain TTFT |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for way in WAYS:
            w = r[way]
            lines.append(
                f"| {r['prompt']} | {-(-r['prompt'] // chunk)} | "
                f"{r['prompt'] * kv_per_token:,} | {way} | "
                f"{w['post_prefill_critical_path_ms']:.1f} ms | {w['ttft_ms']:.0f} ms | "
                f"{w['prefill_ms']:.0f} ms | {r['plain_ttft_ms']:.0f} ms |")
    for r in rows:
        for way in WAYS:
            lines.append(f"sglang_post_prefill_critical_path_ms_{way}_{label(r['prompt'])}="
                         f"{r[way]['post_prefill_critical_path_ms']:.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lengths", default="512,2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--requests", type=int, default=5, help="requests per length and way")
    ap.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it (the servers' "
                    "and daemons' logs, the daemons with --log-requests, the model); "
                    "default: a temporary folder")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    check_len = 3 * args.chunk + 10  # the check's prompt: several chunks
    max_len = max(*lengths, check_len) + 64
    kv_per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="kvbeam-bench-sglang-chunks-")))
        else:
            work = args.keep
            work.mkdir(parents=True, exist_ok=True)
        model = write_model(work / "llama", model_config(args.layers, args.kv_heads,
                                                         args.head_dim, max_len))
        bench = Bench(work, model, args.chunk, max_tokens=4 * max_len,
                      log_requests=args.keep is not None)
        rows = []
        try:
            bench.start()
            # The daemons' handshakes, and the pairs' output against the plain server's
            # (a prompt of several chunks): not in a sample.
            check = [int(t) for t in np.random.default_rng(1).integers(3, 1000, check_len)]
            want = plain_request(bench.ports["plain"], check)[1]
            for way in WAYS:
                got = bench.request(way, check)["output_ids"]
                if got != want:
                    raise RuntimeError(f"{way}: {got} != the plain server's {want}")
            print(f"servers up and checked in {time.monotonic() - t0:.0f} s (both ways give "
                  f"the plain server's {want})", flush=True)
            rng = np.random.default_rng(0)
            for n in lengths:
                rows.append(measure(bench, rng, n, args.requests))
                r = rows[-1]
                print(f"{n} tokens done ({time.monotonic() - t0:.0f} s): " + ", ".join(
                    f"{w} {r[w]['post_prefill_critical_path_ms']:.1f} ms" for w in WAYS),
                    flush=True)
        finally:
            bench.stop()
    print("start-up (s): " + ", ".join(f"{k} {v:.0f}" for k, v in bench.starts.items()))
    print(report(rows, args.chunk, args.layers, kv_per_token, args.requests))
    print(f"total {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
