"""`make bench-layerwise`: what layer-by-layer sends save after vLLM finished a prompt.

Starts two ``--pools engine`` daemons (TCP on loopback), a prefill ``vllm serve`` with
the connector and ``layerwise: true``, a decode ``vllm serve`` with the connector, a
plain ``vllm serve``, and tests/vllm_concurrent_proxy.py over the pair (each request to
prefill and decode at once: decode reserves while prefill computes). The model is a
seeded random Llama deep and wide enough that a prompt's KV is not trivial to move
(``--layers``, float32 KV: ``--kv-heads`` x ``--head-dim`` per token and layer, K and
V). Per prompt length it streams fresh prompts (no prefix hits), one at a time, both
ways in turn:

- ``layerwise``: the proxy names decode's daemon to prefill, so prefill's daemon writes
  each layer as vLLM computes it (docs/vllm.md, "Layer by layer");
- ``whole``: the proxy names no decode, so the send goes whole once the prompt ended,
  to the decode that reserved it (the same servers, the same early reservation).

and, as the reference, the plain server. Printed per length and way (medians):
``post_prefill_critical_path_ms``, from prefill's answer (its prompt done and sampled)
to decode's first token, both at the proxy; TTFT at the client; prefill's daemon's Send
-> Success of the whole sends (its histogram), and that divided by the layers: one
layer's transfer. The lines ``post_prefill_critical_path_ms_{layerwise,whole}_{4k,16k}``
are what ``make bench`` reports. Figures only; no thresholds.

    python -m tests.bench.vllm_layerwise [--lengths 64,4096,16384] [--requests N]
        [--layers N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbeam.integrations.vllm.params import LAYERWISE_MIN_TOKENS
from tests.attach_helpers import start_engine_daemon
from tests.vllm_helpers import TINY_LLAMA
from tests.vllm_served import (
    Served,
    complete,
    concurrent_proxy,
    kv_config,
    metric,
    vllm_serve,
    write_checkpoint,
)

DEADLINES = ["--deadline-bootstrap-s", "600", "--deadline-waiting-s", "600",
             "--deadline-transfer-s", "120", "--heartbeat-s", "1", "--rpc-timeout-s", "30",
             "--send-wait-s", "600"]
WAYS = ("layerwise", "whole")


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


def _transfer_ms(url: str, at_least: float = 0.0) -> tuple[float, float]:
    """Prefill's daemon's Send -> Success histogram (sum, count), once it counts at
    least ``at_least`` (its Success may follow decode's first token by a moment: the
    request before is counted in full, not in the next one's window)."""
    deadline = time.monotonic() + 10
    while True:
        got = (metric(url, "kvbeam_transfer_seconds_sum", state="Success"),
               metric(url, "kvbeam_transfer_seconds_count", state="Success"))
        if got[1] >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def measure(proxy: Served, plain: Served, prefill_metrics: str, rng: np.random.Generator,
            length: int, requests: int, layers: int) -> dict[str, Any]:
    """One prompt length: each way ``requests`` times, in turn, and the plain server."""
    out: dict[str, Any] = {"prompt": length}
    samples: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    whole_s, whole_n = 0.0, 0.0
    done = _transfer_ms(prefill_metrics)[1]  # Successes so far: one more per request
    for _ in range(requests):
        for way in WAYS:
            prompt = [int(t) for t in rng.integers(3, 1024, length)]
            since = len(proxy.lines)
            before = _transfer_ms(prefill_metrics, done)
            done = before[1] + 1
            got = complete(proxy.url, prompt, 2, stream=True, kv_transfer_params={
                "kvbeam_name_decode": way == "layerwise"}, timeout=1800)
            if got.finish != "length":
                raise RuntimeError(f"{way} {length}: {got}")
            prefill_ms, first_ms = _timing(proxy, since)
            samples[way].append((first_ms - prefill_ms, 1000 * got.ttft_s))
            if way == "whole":
                after = _transfer_ms(prefill_metrics, done)
                whole_s += after[0] - before[0]
                whole_n += after[1] - before[1]
    for way in WAYS:
        out[way] = {"post_prefill_critical_path_ms": statistics.median(
                        s[0] for s in samples[way]),
                    "ttft_ms": statistics.median(s[1] for s in samples[way]),
                    "runs": [list(s) for s in samples[way]]}
    plain_ttft = [1000 * complete(plain.url, [int(t) for t in rng.integers(3, 1024, length)],
                                  2, stream=True, timeout=1800).ttft_s for _ in range(requests)]
    out["plain_ttft_ms"] = statistics.median(plain_ttft)
    out["whole_send_to_success_ms"] = 1000 * whole_s / whole_n if whole_n else float("nan")
    out["one_layer_transfer_ms"] = out["whole_send_to_success_ms"] / layers
    return out


def _label(length: int) -> str:
    return f"{length // 1024}k" if length >= 1024 and length % 1024 == 0 else str(length)


def report(rows: list[dict[str, Any]], layers: int, kv_bytes_per_token: int) -> str:
    lines = [f"model: {layers} layers, {kv_bytes_per_token:,} KV bytes per token (all "
             "layers), float32; TCP on loopback; medians",
             "| prompt | KV bytes | way | prefill answered -> decode's first token | TTFT "
             "| plain TTFT | whole Send->Success | one layer's transfer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for way in WAYS:
            w = r[way]
            lines.append(
                f"| {r['prompt']} | {r['prompt'] * kv_bytes_per_token:,} | {way} | "
                f"{w['post_prefill_critical_path_ms']:.1f} ms | {w['ttft_ms']:.0f} ms | "
                f"{r['plain_ttft_ms']:.0f} ms | {r['whole_send_to_success_ms']:.1f} ms | "
                f"{r['one_layer_transfer_ms']:.2f} ms |")
    for r in rows:
        for way in WAYS:
            lines.append(f"post_prefill_critical_path_ms_{way}_{_label(r['prompt'])}="
                         f"{r[way]['post_prefill_critical_path_ms']:.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    deadlines = [*DEADLINES, *(["--integrity", "false"] if args.no_integrity else [])]
    lengths = [int(n) for n in args.lengths.split(",")]
    max_len = max(lengths) + 64
    kv_per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    # Room for two prompts of the longest length in every cache (GiB, rounded up).
    space = str(max(1, -(-2 * max_len * kv_per_token // (1 << 30))))
    env = {"VLLM_CPU_KVCACHE_SPACE": space}
    serve = ["--max-num-seqs", "4", "--enable-chunked-prefill",
             "--max-num-batched-tokens", "2048"]
    with tempfile.TemporaryDirectory(prefix="kvbeam-bench-layerwise-") as work:
        model = write_checkpoint(Path(work) / "llama",
                                 _model(args.layers, args.kv_heads, args.head_dim, max_len))
        started: list[Any] = []
        try:
            t0 = time.monotonic()
            daemons = {}
            for role in ("prefill", "decode"):
                sock = str(Path(work) / f"{role}.sock")
                daemons[role] = (start_engine_daemon(role, sock, deadlines=deadlines), sock)
                started.append(daemons[role][0])
            servers = {}
            for role in ("prefill", "decode"):
                daemon, sock = daemons[role]
                settings: dict[str, Any] = {"daemon": daemon.address, "attach_socket": sock}
                if role == "prefill":
                    settings["layerwise"] = True
                    if args.layerwise_min_tokens is not None:
                        settings["layerwise_min_tokens"] = args.layerwise_min_tokens
                servers[role] = vllm_serve(role, model, args=serve, env=env,
                                           max_model_len=max_len,
                                           kv_transfer_config=kv_config(role, settings))
                started.append(servers[role])
            plain = vllm_serve("plain", model, args=serve, env=env, max_model_len=max_len)
            started.append(plain)
            for s in (*servers.values(), plain):
                s.wait_ready()
            proxy = concurrent_proxy([(servers["prefill"], daemons["prefill"][0])],
                                     [(servers["decode"], daemons["decode"][0])])
            started.append(proxy)
            print(f"servers up in {time.monotonic() - t0:.0f} s", flush=True)
            complete(proxy.url, [5] * 40, 2)  # the daemons' handshake: not in a sample
            complete(plain.url, [5] * 40, 2)
            rng = np.random.default_rng(0)
            metrics = f"http://{daemons['prefill'][0].metrics}/metrics"
            rows = []
            for n in lengths:
                rows.append(measure(proxy, plain, metrics, rng, n, args.requests,
                                    args.layers))
                print(f"{n} tokens done", flush=True)
        finally:
            for s in reversed(started):
                s.stop()
    floor = LAYERWISE_MIN_TOKENS if args.layerwise_min_tokens is None else \
        args.layerwise_min_tokens
    print(f"integrity: {'off' if args.no_integrity else 'on (XXH3-128, the default)'}; "
          f"layerwise_min_tokens: {floor} (shorter prompts go whole both ways)")
    print(report(rows, args.layers, kv_per_token))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
