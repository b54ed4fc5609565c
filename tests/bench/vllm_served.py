"""`make bench-vllm`: TTFT and inter-token latency through vllm-router + kvbeam vs one server.

Starts what tests/host/test_vllm_served.py starts (two ``--pools engine`` daemons, a
prefill and a decode ``vllm serve`` with the connector, vllm-router in PD mode, a plain
``vllm serve``; the tiny seeded Llama, float32, prefix caching on). Per prompt length
and concurrency it streams fresh prompts of that length (new ones per path: no prefix
hits) through the router, to the plain server, and to the decode server alone (no
transfer: its connector's per-step cost without the router hop and prefill). Prints
per cell TTFT and inter-token latency (median, p99) of the three paths, the bytes
decode's daemon landed per request, and where the PD path's extra time goes: decode's
daemon Reserve -> Success and prefill's Send -> Success (the daemons' histograms).
Figures only, beside the direct server measured in the same run; no thresholds.
``--staged``: the pair's connectors stage their KV caches (``staging: true``: the caches
stay in vLLM's tensors, the copies go through host staging buffers, as on a GPU).

    python -m tests.bench.vllm_served [--requests N] [--max-tokens N] [--staged] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tests.vllm_served import Completion, Deployment, complete, metric, start_deployment

SERVE_ARGS = ["--enable-prefix-caching", "--max-num-seqs", "8"]
DEADLINES = ["--deadline-bootstrap-s", "20", "--deadline-waiting-s", "60",
             "--deadline-transfer-s", "30", "--heartbeat-s", "1", "--rpc-timeout-s", "5",
             "--send-wait-s", "30"]
LENGTHS = (64, 256)
CONCURRENCY = (1, 4)


def _q(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``, in ms; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int
         ) -> list[Completion]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens, stream=True), prompts))


def _histogram(url: str, name: str) -> tuple[float, float]:
    return metric(url, f"{name}_sum", state="Success"), metric(url, f"{name}_count",
                                                               state="Success")


def cell(d: Deployment, rng: np.random.Generator, length: int, concurrency: int,
         requests: int, max_tokens: int) -> dict[str, Any]:
    prompts = [[int(t) for t in rng.integers(3, 1024, length)] for _ in range(requests)]
    other = [[int(t) for t in rng.integers(3, 1024, length)] for _ in range(requests)]
    local = [[int(t) for t in rng.integers(3, 1024, length)] for _ in range(requests)]
    d_url = f"http://{d.daemons['decode'].metrics}/metrics"
    p_url = f"http://{d.daemons['prefill'].metrics}/metrics"
    landed0, d_hist0, p_hist0 = d.landed(), _histogram(d_url, "kvbeam_transfer_seconds"), \
        _histogram(p_url, "kvbeam_transfer_seconds")
    t0 = time.monotonic()
    routed = _run(d.router.url, prompts, concurrency, max_tokens)
    routed_s = time.monotonic() - t0
    landed1, d_hist1, p_hist1 = d.landed(), _histogram(d_url, "kvbeam_transfer_seconds"), \
        _histogram(p_url, "kvbeam_transfer_seconds")
    t0 = time.monotonic()
    direct = _run(d.plain.url, other, concurrency, max_tokens)
    direct_s = time.monotonic() - t0
    # The decode server itself, no transfer: its connector's per-step cost without the
    # router hop and the prefill stage.
    on_decode = _run(d.decode.url, local, concurrency, max_tokens)
    moved = landed1[0] - landed0[0]

    def per(h0: tuple[float, float], h1: tuple[float, float]) -> float:
        n = h1[1] - h0[1]
        return 1000 * (h1[0] - h0[0]) / n if n else float("nan")

    def stats(out: list[Completion]) -> dict[str, float]:
        gaps = [g for c in out for g in c.gaps_s]
        return {"ttft_p50_ms": _q([c.ttft_s for c in out], 0.5),
                "ttft_p99_ms": _q([c.ttft_s for c in out], 0.99),
                "itl_p50_ms": _q(gaps, 0.5), "itl_p99_ms": _q(gaps, 0.99),
                "ok": float(sum(c.finish == "length" for c in out))}

    return {"prompt": length, "concurrency": concurrency, "requests": requests,
            "router": stats(routed), "direct": stats(direct), "decode": stats(on_decode),
            "router_s": routed_s, "direct_s": direct_s, "transfers": moved,
            "bytes_per_request": (landed1[1] - landed0[1]) / moved if moved else 0.0,
            "decode_reserve_to_success_ms": per(d_hist0, d_hist1),
            "prefill_send_to_success_ms": per(p_hist0, p_hist1)}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| prompt | conc | path | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | bytes/req | "
            "decode Reserve->Success | prefill Send->Success |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        for path in ("router", "decode", "direct"):
            s = r[path]
            extra = (f"{r['bytes_per_request']:,.0f} | {r['decode_reserve_to_success_ms']:.1f} ms"
                     f" | {r['prefill_send_to_success_ms']:.1f} ms" if path == "router"
                     else "- | - | -")
            lines.append(f"| {r['prompt']} | {r['concurrency']} | {path} | "
                         f"{s['ttft_p50_ms']:.0f} ms | {s['ttft_p99_ms']:.0f} ms | "
                         f"{s['itl_p50_ms']:.1f} ms | {s['itl_p99_ms']:.1f} ms | {extra} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="requests per cell and path")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--staged", action="store_true",
                    help="the pair stages its KV caches through host buffers")
    args = ap.parse_args()
    staged = {"staging": True}
    with tempfile.TemporaryDirectory(prefix="kvbeam-bench-vllm-") as work:
        t0 = time.monotonic()
        d = start_deployment(Path(work), SERVE_ARGS, DEADLINES, extra={
            "prefill": staged, "decode": staged} if args.staged else None)
        print(f"servers up in {time.monotonic() - t0:.0f} s", flush=True)
        try:
            rng = np.random.default_rng(0)
            # One warm-up request each: the first request pays the daemons' handshake.
            complete(d.router.url, [5] * 40, 2)
            complete(d.plain.url, [5] * 40, 2)
            rows = [cell(d, rng, n, c, args.requests, args.max_tokens)
                    for n in LENGTHS for c in CONCURRENCY]
        finally:
            d.stop()
    print(f"pair: {'staged' if args.staged else 'shared memory'}")
    print(table(rows))
    for r in rows:
        if any(r[path]["ok"] != r["requests"] for path in ("router", "decode", "direct")):
            print(f"WARNING: cell {r['prompt']}x{r['concurrency']}: not every request "
                  "finished with length", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
