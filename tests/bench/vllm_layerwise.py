"""`make bench-layerwise`: what layer-by-layer sends save after vLLM finished a prompt.

Starts two ``--pools engine`` daemons (TCP on loopback), a prefill ``vllm serve`` with
the connector and ``layerwise: true``, a decode ``vllm serve`` with the connector, a
plain ``vllm serve``, and in front of the pair (``--router``):

- ``concurrent`` (the default): tests/vllm_concurrent_proxy.py (each request to prefill
  and decode at once: decode reserves while prefill computes);
- ``vllm-router``: vLLM's own router in its PD mode (prefill first, then decode with
  what prefill returned: decode reserves only once prefill answered), two of them over
  the same pair, one per way; prefill's ``decode_daemons`` maps decode's
  ``127.0.0.1:PORT`` to its daemon.

The model is a seeded random Llama deep and wide enough that a prompt's KV is not
trivial to move (``--layers``, float32 KV: ``--kv-heads`` x ``--head-dim`` per token
and layer, K and V). Per prompt length it streams fresh prompts (no prefix hits), one
at a time, both ways in turn (layerwise first in even rounds, whole first in odd):

- ``layerwise``: decode's daemon is named to prefill (the proxy's ``decode_daemon``;
  the first router names decode ``127.0.0.1:PORT``, which ``decode_daemons`` maps), so
  prefill's daemon writes each layer as vLLM computes it (docs/vllm.md, "Layer by
  layer"); behind vllm-router the layers wait there for decode's reservation;
- ``whole``: no decode named (the proxy names none; the second router names decode
  ``localhost:PORT``, which ``decode_daemons`` lacks: prefill logs a WARNING a minute
  and counts ``unmapped_decode``, as with vllm-router's recommended setup, no
  ``decode_daemons``), so the send goes whole once the prompt ended, to the decode that
  reserves it (the same servers).

and, as the reference, the plain server. Prompts under ``layerwise_min_tokens`` go
whole both ways. Printed per length and way (medians; TTFT also min-max):
``post_prefill_critical_path_ms``, from prefill's answer (its prompt done and sampled)
to decode's first token: at the proxy; behind vllm-router (no per-phase timing of its
own) from prefill's access-log line for the answer, as this process read it, to the
first token at the client (the router's hop to decode included). TTFT at the client,
and the paired difference layerwise - whole (request i of each way). Concurrent:
prefill's daemon's Send -> Success of the whole sends (its histogram), and that divided
by the layers: one layer's transfer. vllm-router: decode's daemon's Reserve -> Success
and the client's end to end (both tokens). Both fronts: the CPU each request cost
prefill's daemon, prefill's vLLM (its engine core included) and decode's daemon, the
mean per way. The lines
``post_prefill_critical_path_ms_{layerwise,whole}_{4k,16k}`` are what ``make bench``
reports. Figures only, no thresholds; it fails if prefill streamed other than the
layerwise requests of at least ``layerwise_min_tokens`` (or, behind vllm-router, did not
count each whole one unmapped).

    python -m tests.bench.vllm_layerwise [--router {concurrent,vllm-router}]
        [--lengths 64,4096,16384] [--requests N] [--layers N] [--keep DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbeam.integrations.vllm.params import LAYERWISE_MIN_TOKENS
from kvbeam.procs import DaemonProcess
from tests.attach_helpers import start_engine_daemon
from tests.bench.bench_request import cpu_s
from tests.vllm_helpers import TINY_LLAMA
from tests.vllm_served import (
    Completion,
    Served,
    complete,
    concurrent_proxy,
    descendants,
    free_port,
    kv_config,
    metric,
    vllm_router,
    vllm_serve,
    write_checkpoint,
)

DEADLINES = ["--deadline-bootstrap-s", "600", "--deadline-waiting-s", "600",
             "--deadline-transfer-s", "120", "--heartbeat-s", "1", "--rpc-timeout-s", "30",
             "--send-wait-s", "600"]
WAYS = ("layerwise", "whole")
ROUTERS = ("concurrent", "vllm-router")
#: A vLLM server's access-log line for a completion: printed when its answer begins
#: (uvicorn logs at the response's start; prefill's answer is not streamed).
ANSWERED = '"POST /v1/completions HTTP/1.1" 200'


def _model(layers: int, kv_heads: int, head_dim: int, max_len: int) -> dict[str, Any]:
    """A Llama of ``layers`` layers whose KV per token and layer is K and V of
    ``kv_heads`` x ``head_dim`` float32 (narrow otherwise: the prompt's compute stays
    small beside its KV)."""
    return {**TINY_LLAMA, "num_hidden_layers": layers, "num_attention_heads": kv_heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hidden_size": kv_heads * head_dim, "intermediate_size": 2 * kv_heads * head_dim,
            "max_position_embeddings": max_len}


def _timing(proxy: Served, since: int) -> tuple[float, float]:
    """(prefill answered, decode's first bytes) in ms, of the proxy's one request after
    output line ``since``, once it printed them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in proxy.lines[since:]:
            if line.startswith("timing "):
                fields = dict(part.split("=", 1) for part in line.split()[2:])
                return float(fields["prefill_ms"]), float(fields["decode_first_ms"])
        time.sleep(0.05)
    raise RuntimeError(f"the proxy printed no timing: {proxy.lines[since:]}")


def _answered(server: Served, since: int) -> float:
    """When ``server``'s first completion after output line ``since`` began its answer
    (monotonic: when this process read its access-log line), once it logged it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for i in range(since, len(server.lines)):
            if ANSWERED in server.lines[i]:
                return server.line_times[i]
        time.sleep(0.01)
    raise RuntimeError(f"prefill logged no answer: {server.lines[since:]}")


class Front:
    """What sends the requests to the pair, each way, and when prefill answered."""

    def warm(self) -> None:
        """A short request each way (the daemons' handshakes): not in a sample."""
        for way in WAYS:
            self.send(way, [5] * 40)

    def send(self, way: str, prompt: list[int]) -> tuple[Completion, float]:
        """The streamed completion of ``prompt`` (2 tokens), and prefill's answer ->
        decode's first token, ms."""
        raise NotImplementedError


class Concurrent(Front):
    """tests/vllm_concurrent_proxy.py: decode reserves while prefill computes; the
    timing is the proxy's."""

    def __init__(self, proxy: Served) -> None:
        self.proxy = proxy

    def send(self, way: str, prompt: list[int]) -> tuple[Completion, float]:
        since = len(self.proxy.lines)
        got = complete(self.proxy.url, prompt, 2, stream=True, kv_transfer_params={
            "kvbeam_name_decode": way == "layerwise"}, timeout=1800)
        if got.finish != "length":
            return got, float("nan")
        prefill_ms, first_ms = _timing(self.proxy, since)
        return got, first_ms - prefill_ms


class Router(Front):
    """vllm-router, one per way over the same pair: decode reserves once prefill
    answered. Prefill's answer: its access-log line as this process read it."""

    def __init__(self, routers: dict[str, Served], prefill: Served) -> None:
        self.routers = routers
        self.prefill = prefill

    def send(self, way: str, prompt: list[int]) -> tuple[Completion, float]:
        since = len(self.prefill.lines)
        t0 = time.monotonic()
        got = complete(self.routers[way].url, prompt, 2, stream=True, timeout=1800)
        if got.finish != "length":
            return got, float("nan")
        return got, 1000 * (t0 + got.ttft_s - _answered(self.prefill, since))


def _transfer_ms(url: str, at_least: float = 0.0) -> tuple[float, float]:
    """A daemon's Send/Reserve -> Success histogram (sum, count), once it counts at
    least ``at_least`` (prefill's Success may follow decode's first token by a moment:
    the request before is counted in full, not in the next one's window)."""
    deadline = time.monotonic() + 10
    while True:
        got = (metric(url, "kvbeam_transfer_seconds_sum", state="Success"),
               metric(url, "kvbeam_transfer_seconds_count", state="Success"))
        if got[1] >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` and every process under it (vLLM's engine core is
    a child of ``vllm serve``); a process that ended meanwhile counts for nothing."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):
            total += cpu_s(p)
    return total


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(front: Front, plain: Served, daemons: dict[str, str], rng: np.random.Generator,
            length: int, requests: int, layers: int,
            cpu_pids: dict[str, int]) -> dict[str, Any]:
    """One prompt length: each way ``requests`` times, in turn (the first way
    alternating), and the plain server.
    ``daemons``: the prefill and decode daemons' /metrics; ``cpu_pids``: the processes
    whose CPU each request is charged (``{name}_cpu_ms``: a process and its children,
    in clock ticks of 10 ms, so read as a mean over the requests)."""
    out: dict[str, Any] = {"prompt": length}
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    before = {role: _transfer_ms(url) for role, url in daemons.items()}
    for i in range(requests):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:  # neither always follows the other
            prompt = [int(t) for t in rng.integers(3, 1024, length)]
            cpu0 = {name: tree_cpu_s(pid) for name, pid in cpu_pids.items()}
            got, post_ms = front.send(way, prompt)
            if got.finish != "length":
                raise RuntimeError(f"{way} {length}: {got}")
            after = {role: _transfer_ms(url, before[role][1] + 1)
                     for role, url in daemons.items()}
            runs[way].append({
                "post_prefill_critical_path_ms": post_ms, "ttft_ms": 1000 * got.ttft_s,
                "end_to_end_ms": 1000 * (got.ttft_s + sum(got.gaps_s)),
                "prefill_send_to_success_ms": 1000 * (after["prefill"][0] - before["prefill"][0]),
                "decode_reserve_to_success_ms":
                    1000 * (after["decode"][0] - before["decode"][0]),
                **{f"{name}_cpu_ms": 1000 * (tree_cpu_s(pid) - cpu0[name])
                   for name, pid in cpu_pids.items()}})
            before = after
    for way in WAYS:
        out[way] = {k: statistics.median(r[k] for r in runs[way]) for k in runs[way][0]}
        out[way] |= {"ttft": _summary([r["ttft_ms"] for r in runs[way]]),
                     "post_prefill_critical_path": _summary(
                         [r["post_prefill_critical_path_ms"] for r in runs[way]]),
                     "runs": runs[way]}
    out["cpu_ms_mean"] = {way: {name: statistics.mean(r[f"{name}_cpu_ms"] for r in runs[way])
                                for name in cpu_pids} for way in WAYS}
    out["ttft_layerwise_minus_whole"] = _summary([
        a["ttft_ms"] - b["ttft_ms"] for a, b in zip(runs["layerwise"], runs["whole"],
                                                    strict=True)])
    plain_ttft = [1000 * complete(plain.url, [int(t) for t in rng.integers(3, 1024, length)],
                                  2, stream=True, timeout=1800).ttft_s for _ in range(requests)]
    out["plain_ttft_ms"] = statistics.median(plain_ttft)
    out["whole_send_to_success_ms"] = statistics.mean(
        r["prefill_send_to_success_ms"] for r in runs["whole"])
    out["one_layer_transfer_ms"] = out["whole_send_to_success_ms"] / layers
    return out


def _label(length: int) -> str:
    return f"{length // 1024}k" if length >= 1024 and length % 1024 == 0 else str(length)


def _spread(s: dict[str, float], digits: int = 0) -> str:
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f} to {s['max']:,.{digits}f})"


def report(rows: list[dict[str, Any]], router: str, layers: int, kv_bytes_per_token: int
           ) -> str:
    concurrent = router == "concurrent"
    lines = [f"front: {router}; model: {layers} layers, {kv_bytes_per_token:,} KV bytes per "
             "token (all layers), float32; TCP on loopback; medians (min to max)"]
    if concurrent:
        lines += ["| prompt | KV bytes | way | prefill answered -> decode's first token | "
                  "TTFT | plain TTFT | whole Send->Success | one layer's transfer |",
                  "|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| prompt | KV bytes | way | TTFT | prefill answered -> first token at the "
                  "client | decode Reserve->Success | end to end | plain TTFT |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for way in WAYS:
            w = r[way]
            head = f"| {r['prompt']} | {r['prompt'] * kv_bytes_per_token:,} | {way} | "
            if concurrent:
                lines.append(
                    f"{head}{w['post_prefill_critical_path_ms']:.1f} ms | "
                    f"{_spread(w['ttft'])} ms | {r['plain_ttft_ms']:,.0f} ms | "
                    f"{r['whole_send_to_success_ms']:.1f} ms | "
                    f"{r['one_layer_transfer_ms']:.2f} ms |")
            else:
                lines.append(
                    f"{head}{_spread(w['ttft'])} ms | "
                    f"{_spread(w['post_prefill_critical_path'], 1)} ms | "
                    f"{w['decode_reserve_to_success_ms']:.1f} ms | "
                    f"{w['end_to_end_ms']:,.0f} ms | {r['plain_ttft_ms']:,.0f} ms |")
    prefix = "" if concurrent else "router_"
    for r in rows:
        cpu = r["cpu_ms_mean"]
        lines.append(f"{r['prompt']} tokens, CPU per request (mean), layerwise / whole: " +
                     "; ".join(f"{name} {cpu['layerwise'][name]:,.1f} / "
                               f"{cpu['whole'][name]:,.1f} ms" for name in cpu["whole"]))
    for r in rows:
        label = _label(r["prompt"])
        for way in WAYS:
            lines.append(f"{prefix}post_prefill_critical_path_ms_{way}_{label}="
                         f"{r[way]['post_prefill_critical_path_ms']:.1f}")
        lines.append(f"{prefix}ttft_layerwise_minus_whole_ms_{label}="
                     f"{r['ttft_layerwise_minus_whole']['median']:.1f} (paired, min "
                     f"{r['ttft_layerwise_minus_whole']['min']:.1f}, max "
                     f"{r['ttft_layerwise_minus_whole']['max']:.1f})")
    return "\n".join(lines)


def _events(url: str) -> dict[str, float]:
    """Prefill vLLM's streamed and unmapped_decode counts."""
    return {e: metric(url, "vllm:kvbeam_events_total", event=e)
            for e in ("streamed", "unmapped_decode")}


def _check_events(url: str, since: dict[str, float], want: dict[str, float]) -> str:
    """What prefill counted since ``since`` against ``want``: "" when they match (vLLM's
    stats reach /metrics with its next log line: waits up to 30 s), else why not."""
    deadline = time.monotonic() + 30
    while True:
        now = _events(url)
        got = {e: now[e] - since[e] for e in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return "" if got == want else f"prefill counted {got}, expected {want}"


def _front(router: str, prefill: tuple[Served, DaemonProcess],
           decode: tuple[Served, DaemonProcess]) -> tuple[Front, list[Served]]:
    """The front of ``--router`` over the pair, ready, and the processes it started."""
    if router == "concurrent":
        proxy = concurrent_proxy([prefill], [decode])
        return Concurrent(proxy), [proxy]
    # Both routers name the same decode server: as 127.0.0.1 (prefill's decode_daemons
    # maps it, so its sends name decode's daemon) and as localhost (it does not; the
    # router reaches 127.0.0.1 through it, the request id says "localhost:PORT").
    routers = {"layerwise": vllm_router([prefill[0].url], [decode[0].url],
                                        name="router-layerwise"),
               "whole": vllm_router([prefill[0].url], [f"http://localhost:{decode[0].port}"],
                                    name="router-whole")}
    try:
        for r in routers.values():
            r.wait_ready()
    except BaseException:
        for r in routers.values():
            r.stop()
        raise
    return Router(routers, prefill[0]), list(routers.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--router", choices=ROUTERS, default="concurrent",
                    help="concurrent: tests/vllm_concurrent_proxy.py (decode reserves while "
                         "prefill computes); vllm-router: vLLM's router in PD mode (decode "
                         "reserves once prefill answered)")
    ap.add_argument("--lengths", default="64,4096,16384",
                    help="prompt lengths, comma-separated (the shortest: the fixed cost)")
    ap.add_argument("--requests", type=int, default=3, help="requests per length and way")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layerwise-min-tokens", type=int, default=None,
                    help="prefill's layerwise_min_tokens (default: the connector's; 0 "
                         "streams every prompt)")
    ap.add_argument("--no-integrity", action="store_true",
                    help="the daemons without digests (what integrity costs at the end)")
    ap.add_argument("--keep", type=Path,
                    help="write every daemon's (with --log-requests), server's and the "
                         "front's output here, one file each")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    deadlines = [*DEADLINES, *(["--integrity", "false"] if args.no_integrity else []),
                 *(["--log-requests", "true"] if args.keep else [])]
    lengths = [int(n) for n in args.lengths.split(",")]
    floor = LAYERWISE_MIN_TOKENS if args.layerwise_min_tokens is None else \
        args.layerwise_min_tokens
    max_len = max(lengths) + 64
    kv_per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    # Room for two prompts of the longest length in every cache (GiB, rounded up).
    space = str(max(1, -(-2 * max_len * kv_per_token // (1 << 30))))
    env = {"VLLM_CPU_KVCACHE_SPACE": space}
    serve = ["--max-num-seqs", "4", "--enable-chunked-prefill",
             "--max-num-batched-tokens", "2048"]
    mismatch = ""
    with tempfile.TemporaryDirectory(prefix="kvbeam-bench-layerwise-") as work:
        model = write_checkpoint(Path(work) / "llama",
                                 _model(args.layers, args.kv_heads, args.head_dim, max_len))
        started: list[Served | DaemonProcess] = []
        try:
            t0 = time.monotonic()
            daemons = {}
            for role in ("prefill", "decode"):
                sock = str(Path(work) / f"{role}.sock")
                daemons[role] = (start_engine_daemon(role, sock, deadlines=deadlines), sock)
                started.append(daemons[role][0])
            decode_port = free_port()
            servers = {}
            for role in ("prefill", "decode"):
                daemon, sock = daemons[role]
                settings: dict[str, Any] = {"daemon": daemon.address, "attach_socket": sock}
                if role == "prefill":
                    settings["layerwise"] = True
                    if args.layerwise_min_tokens is not None:
                        settings["layerwise_min_tokens"] = args.layerwise_min_tokens
                    if args.router == "vllm-router":  # vllm-router names it 127.0.0.1:PORT
                        settings["decode_daemons"] = {
                            f"127.0.0.1:{decode_port}": daemons["decode"][0].address}
                servers[role] = vllm_serve(role, model, args=serve, env=env,
                                           max_model_len=max_len,
                                           port=decode_port if role == "decode" else None,
                                           kv_transfer_config=kv_config(role, settings))
                started.append(servers[role])
            plain = vllm_serve("plain", model, args=serve, env=env, max_model_len=max_len)
            started.append(plain)
            for s in (*servers.values(), plain):
                s.wait_ready()
            front, fronts = _front(args.router, (servers["prefill"], daemons["prefill"][0]),
                                   (servers["decode"], daemons["decode"][0]))
            started += fronts
            print(f"servers up in {time.monotonic() - t0:.0f} s", flush=True)
            front.warm()
            complete(plain.url, [5] * 40, 2)
            rng = np.random.default_rng(0)
            metrics = {role: f"http://{d.metrics}/metrics" for role, (d, _) in daemons.items()}
            prefill_vllm = f"{servers['prefill'].url}/metrics"
            events = _events(prefill_vllm)
            cpu_pids = {"prefill_daemon": daemons["prefill"][0].proc.pid,
                        "prefill_vllm": servers["prefill"].proc.pid,
                        "decode_daemon": daemons["decode"][0].proc.pid}
            rows = []
            for n in lengths:
                rows.append(measure(front, plain, metrics, rng, n, args.requests,
                                    args.layers, cpu_pids))
                print(f"{n} tokens done", flush=True)
            mismatch = _check_events(prefill_vllm, events, {
                "streamed": float(args.requests * sum(n >= floor for n in lengths)),
                **({} if args.router == "concurrent" else
                   {"unmapped_decode": float(args.requests * len(lengths))})})
        finally:
            for p in reversed(started):
                p.stop()
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for p in started:
                    name = p.name if isinstance(p, Served) else f"{p.role}-daemon"
                    (args.keep / f"{name}.log").write_text("".join(p.lines))
    print(f"integrity: {'off' if args.no_integrity else 'on (XXH3-128, the default)'}; "
          f"layerwise_min_tokens: {floor} (shorter prompts go whole both ways)")
    print(report(rows, args.router, args.layers, kv_per_token))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if mismatch:
        raise SystemExit(f"not every request went the way it was meant to: {mismatch}")


if __name__ == "__main__":
    main()
