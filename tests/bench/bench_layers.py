"""Benchmark: what sending a request layer by layer saves after prefill's last layer
(issue 48), through the engine channel, where vLLM cannot run (the soft-RoCE guest).

Two ``--pools engine`` daemons (``--transport``: ``rdma`` on the device of
``KVBEAM_RDMA_DEVICE``, as inside the soft-RoCE harness, or ``tcp`` on loopback) and a
tests/channel_engine.py process attached to each (``pushes="final"``, as the vLLM and
sglang integrations attach), started by ``attached_pair`` as
tests/rdma/test_layers_rdma.py starts them. The model is the one ``make
bench-layerwise`` gives vLLM on the host: a paged pool (vLLM's kind: one buffer per
layer, in layer order) of ``--layers`` layers, blocks of 32 tokens, 2 KV heads of 64
dims, float32 (16 KiB a token over 16 layers). Integrity is on (the default), and
decode's ``--verify-sub-batch-mib`` (``--sub-batch-mib``) cuts every measured request
into sub-batches of about one layer each, so each layer's piece carries its
sub-batch's mark and decode verifies it while later layers are computed.

Per request length, decode's engine reserves first (prefill's daemon holds decode's
Offer before anything is sent), then prefill's engine runs ``--layers`` layers of
``COMPUTE_MS`` each (a sleep in the engine process) and sends them:

- **layerwise**: after layer n < L a piece ready in n layers (the first gives every KV
  page), after layer L the final chunk (as vLLM's connector: the last layer's frame is
  the final one);
- **whole**: nothing until layer L is computed, then one send of everything.

``post_prefill_critical_path_ms`` is the time from the moment the last layer is ready
(just before prefill's engine issues the final chunk, or the whole send) to decode's
Success as decode's engine sees it (the time its wait for the pushed STATE returned),
both CLOCK_MONOTONIC in their own processes (one clock per machine). The median of
``--repeat`` requests each way, the two ways alternating (layerwise first in even
rounds, whole first in odd ones). Beside it: one layer's transfer (the whole sends'
Send -> Success over L), the fixed per-request cost (``--tiny-tokens``, one block,
sent whole with no compute: its Send -> Success), and the split of each critical path:
prefill's log line once its final chunk's writes were posted (wall clock, ms), prefill's
Success at its engine (its writes and record completed), and decode's verdict after the
landing (decode's Success line), so the landing came at about critical path - that;
with how many layers the final frame carried (more than one when the pieces fell
behind the compute). The daemons run with ``--log-requests true`` for those lines.

``COMPUTE_MS`` per layer is ``--compute-ms``, or by default ``--compute-factor`` (1.25)
times one layer's transfer as two whole sends with no compute measure it first (a bit
longer than a layer's transfer, so the pieces overlap compute as in a real prefill).

Prints a table and ``{transport}_post_prefill_critical_path_ms_{layerwise,whole}_N=``,
``{transport}_layerwise_vs_whole_N=``, ``{transport}_one_layer_transfer_ms_N=`` and
``{transport}_fixed_request_ms=`` lines (N: tokens). Figures only; no thresholds.

    python -m tests.bench.bench_layers [--transport rdma|tcp] [--tokens 1024,4096]
        [--repeat 5] [--layers 16] [--compute-ms MS] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.procs import DaemonProcess
from tests.attach_helpers import write_config
from tests.bench.bench_request import cpu_s
from tests.daemon_helpers import SLOW_GUEST

if TYPE_CHECKING:  # imported where the daemons start: bench_suite prints report() alone
    from tests.host.test_engine_channel import ChannelEngine

WAYS = ("layerwise", "whole")
BLOCK = 32  # tokens a block (make bench-layerwise's vLLM block size)
#: Seconds an engine command may take (a prefill of 16 layers of 4k tokens takes a few
#: seconds in the TCG guest).
COMMAND_S = 300.0


def model(layers: int, max_tokens: int) -> SideConfig:
    """The paged model: ``layers`` layers, 2 KV heads of 64 dims, float32; blocks for two
    requests of ``max_tokens`` (random lists pick from the whole pool)."""
    blocks = 2 * -(-max_tokens // BLOCK)
    return paged_side_config("bench-layers", paged_spec(
        num_layers=layers, block_size=BLOCK, num_kv_heads=2, head_size=64, dtype="float32",
        inner_layout="LBHNC", num_blocks=blocks, max_inflight=4))


@dataclass
class Sample:
    """One request: its times in ms after the last layer was ready (``t0``)."""

    rid: str
    way: str
    critical_ms: float  # -> decode's Success at its engine
    prefill_ms: float  # -> prefill's Success at its engine (its writes completed)
    check_ms: float = float("nan")  # decode's record and check (its log)
    after_landing_ms: float = float("nan")  # decode's landing -> its verdict (its log)
    marks: str = ""  # "K of K+1" sub-batches digested as they landed
    final_bytes: int = 0  # what prefill's final chunk wrote (its log; the record aside)
    final_blocks: int = 0
    wall0: float = 0.0  # t0 on the wall clock (the daemons' log lines are)
    posted_ms: float = float("nan")  # -> prefill's log line for its final chunk's posts
    prefill_cpu_ms: float = float("nan")  # prefill's daemon, reserve -> release (all threads)
    decode_cpu_ms: float = float("nan")  # decode's daemon, the same span


def _offers(daemon: DaemonProcess) -> float:
    """Decode's offers prefill's daemon received so far (its /metrics)."""
    with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    m = re.search(r'^kvbeam_offers_total\{event="received"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


class Pair:
    """The two daemons and their engines; runs one request at a time."""

    def __init__(self, prefill: DaemonProcess, decode: DaemonProcess, pe: ChannelEngine,
                 de: ChannelEngine) -> None:
        self.prefill, self.decode, self.pe, self.de = prefill, decode, pe, de
        self.count = 0

    def request(self, tokens: int, layers: int, compute_ms: float, way: str,
                offer_s: float = 60.0) -> Sample:
        """Decode reserves (and prefill's daemon holds its Offer, up to ``offer_s``: the
        first request of the pair handshakes instead), then prefill runs ``layers``
        layers of ``compute_ms`` and sends them ``way``; decode releases."""
        self.count += 1
        rid, seed = f"{way[0]}{tokens}-{self.count}", 1000 + 2 * self.count
        pe, de = self.pe, self.de
        before = _offers(self.prefill)
        cpu0 = (cpu_s(self.prefill.proc.pid), cpu_s(self.decode.proc.pid))
        assert de.cmd(f"reserve {rid} {tokens} {self.prefill.address} {seed}"
                      ) == f"reserve {rid}"
        end = time.monotonic() + offer_s
        while _offers(self.prefill) <= before and time.monotonic() < end:
            time.sleep(0.05)
        assert de.cmd(f"stamp {rid}") == f"stamp {rid}"
        answer = pe.cmd(f"prefill {rid} {tokens} {self.decode.address} {seed + 1} {layers} "
                        f"{compute_ms:.3f} {way}", COMMAND_S)
        parts = answer.split(maxsplit=5)
        got = de.cmd(f"stamped {rid}", COMMAND_S)
        state, t_decode = got.rsplit(maxsplit=1)
        if parts[0] != "prefilled" or parts[5] != "Success" or state != "Success":
            raise RuntimeError(f"{rid}: prefill answered {answer!r}, decode {got!r}")
        assert de.cmd(f"release {rid}") == "released"
        # The metrics scrapes above count in both spans alike (one per request and way).
        cpu1 = (cpu_s(self.prefill.proc.pid), cpu_s(self.decode.proc.pid))
        t0, t_prefill = float(parts[2]), float(parts[3])
        return Sample(rid, way, (float(t_decode) - t0) * 1000, (t_prefill - t0) * 1000,
                      wall0=float(parts[4]), prefill_cpu_ms=(cpu1[0] - cpu0[0]) * 1000,
                      decode_cpu_ms=(cpu1[1] - cpu0[1]) * 1000)


#: Decode's Success line (``--log-requests``): its record and check, and when its
#: verdict came after the landing (the last write's notification).
_VERIFIED = re.compile(r"request (\S+): Success \(\d+ bytes landed in slot -?\d+; .*?record "
                       r"and check ([\d.]+) ms, ([\d.]+) ms after the landing"
                       r"(?:, (\d+ of \d+) sub-batches digested as they landed)?")
#: Prefill's line for its final chunk (``--log-requests``), logged once its writes were
#: posted: when, and what the last piece wrote.
_FINAL = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?request (\S+): posted "
                    r"final chunk, (\d+) bytes in (\d+) blocks", re.M)


def _log_time(stamp: str) -> float:
    """A text log line's time (local, ms) as seconds since the epoch."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def add_logs(prefill: DaemonProcess, decode: DaemonProcess, samples: list[Sample]) -> None:
    """Fill each sample's decode check and prefill's final chunk from the daemons'
    request lines."""
    want = {s.rid: s for s in samples}
    deadline = time.monotonic() + 10
    while True:
        for m in _VERIFIED.finditer(decode.output):
            s = want.get(m.group(1))
            if s is not None:
                s.check_ms, s.after_landing_ms = float(m.group(2)), float(m.group(3))
                s.marks = m.group(4) or ""
        for m in _FINAL.finditer(prefill.output):
            s = want.get(m.group(2))
            if s is not None:
                s.final_bytes, s.final_blocks = int(m.group(3)), int(m.group(4))
                s.posted_ms = (_log_time(m.group(1)) - s.wall0) * 1000
        if all(s.check_ms == s.check_ms and s.final_bytes for s in samples) \
                or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def med(values: list[float]) -> float:
    """The median, NaN when there is none."""
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def measure(pair: Pair, tokens: int, layers: int, kv_bytes: int, repeat: int,
            compute_ms: float | None, factor: float) -> dict[str, Any]:
    """One request length (``kv_bytes`` of KV): the calibration (two whole sends, no
    compute), then each way ``repeat`` times, alternating."""
    calib = [pair.request(tokens, layers, 0.0, "whole") for _ in range(2)]
    per_layer = min(s.critical_ms for s in calib) / layers
    compute = compute_ms if compute_ms is not None else factor * per_layer
    log(f"{tokens} tokens: whole with no compute {[round(s.critical_ms, 1) for s in calib]} "
        f"ms; compute {compute:.1f} ms per layer")
    samples: dict[str, list[Sample]] = {w: [] for w in WAYS}
    for i in range(repeat):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            s = pair.request(tokens, layers, compute, way)
            samples[way].append(s)
            log(f"{tokens} {way}: {s.critical_ms:.1f} ms after the last layer "
                f"(prefill's Success {s.prefill_ms:.1f} ms)")
    add_logs(pair.prefill, pair.decode, [*calib, *samples["layerwise"], *samples["whole"]])
    out: dict[str, Any] = {"tokens": tokens, "compute_ms_per_layer": compute,
                           "calibration_ms": [s.critical_ms for s in calib]}
    for way in WAYS:
        runs = samples[way]
        out[way] = {"post_prefill_critical_path_ms": med([s.critical_ms for s in runs]),
                    "prefill_success_ms": med([s.prefill_ms for s in runs]),
                    "decode_check_ms": med([s.check_ms for s in runs]),
                    "decode_after_landing_ms": med([s.after_landing_ms for s in runs]),
                    "landing_ms": med([s.critical_ms - s.after_landing_ms for s in runs]),
                    "marks": sorted({s.marks for s in runs}),
                    "final_chunk_bytes": med([float(s.final_bytes) for s in runs]),
                    "final_chunk_layers": sorted({s.final_bytes * layers // kv_bytes
                                                  for s in runs}),
                    "final_posted_ms": med([s.posted_ms for s in runs]),
                    "prefill_cpu_ms": med([s.prefill_cpu_ms for s in runs]),
                    "decode_cpu_ms": med([s.decode_cpu_ms for s in runs]),
                    "runs": [asdict(s) for s in runs]}
    whole = out["whole"]["post_prefill_critical_path_ms"]
    out["one_layer_transfer_ms"] = whole / layers
    out["layerwise_vs_whole"] = out["layerwise"]["post_prefill_critical_path_ms"] / whole
    return out


def log(msg: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"[bench_layers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def report(res: dict[str, Any]) -> str:
    """The tables and the name=value lines."""
    t = res["transport"]
    where = "RDMA (soft-RoCE)" if t == "rdma" else "TCP on loopback"
    lines = [
        f"# layer by layer vs whole after prefill's last layer, engine channel, {where}; "
        f"{res['layers']} layers, {res['kv_bytes_per_token']:,} KV bytes a token, "
        f"integrity on, decode's sub-batches {res['sub_batch_mib']:g} MiB; medians of "
        f"{res['repeat']} each way, alternating",
        f"# fixed per-request cost: {res['tiny_tokens']} tokens "
        f"({res['tiny_tokens'] * res['kv_bytes_per_token']:,} bytes) sent whole, Send -> "
        f"Success {res['fixed_request_ms']:.1f} ms (runs "
        f"{', '.join(f'{v:.1f}' for v in res['fixed_runs_ms'])})",
        "| tokens | KV bytes | way | compute per layer | last layer ready -> decode's Success "
        "| runs | whole Send->Success | one layer's transfer |",
        "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        whole = r["whole"]["post_prefill_critical_path_ms"]
        for way in WAYS:
            w = r[way]
            runs = ", ".join(f"{s['critical_ms']:.1f}" for s in w["runs"])
            lines.append(
                f"| {r['tokens']} | {r['tokens'] * res['kv_bytes_per_token']:,} | {way} | "
                f"{r['compute_ms_per_layer']:.1f} ms | "
                f"**{w['post_prefill_critical_path_ms']:.1f} ms** | {runs} | "
                f"{whole:.1f} ms | {r['one_layer_transfer_ms']:.2f} ms |")
    lines += [
        "# after the last layer, medians in ms: prefill's final frame -> its log line "
        "once the final chunk's writes were posted (wall clock, ms), -> prefill's Success "
        "at its engine (its writes and record completed), -> decode's landing (decode's "
        "Success at its engine less its verdict's time after the landing); decode's "
        "record and check: its verdict after the landing",
        "| tokens | way | layers in the final frame | its bytes | posted | prefill's Success "
        "| decode landed | decode's check after the landing | sub-batches verified as they "
        "landed | daemon CPU a request, prefill / decode |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for way in WAYS:
            w = r[way]
            lines.append(
                f"| {r['tokens']} | {way} | "
                f"{', '.join(map(str, w['final_chunk_layers']))} | "
                f"{w['final_chunk_bytes']:,.0f} | {w['final_posted_ms']:.1f} | "
                f"{w['prefill_success_ms']:.1f} | {w['landing_ms']:.1f} | "
                f"{w['decode_after_landing_ms']:.1f} | {'; '.join(w['marks']) or '-'} | "
                f"{w['prefill_cpu_ms']:.0f} / {w['decode_cpu_ms']:.0f} ms |")
    for r in res["rows"]:
        n = r["tokens"]
        for way in WAYS:
            lines.append(f"{t}_post_prefill_critical_path_ms_{way}_{n}="
                         f"{r[way]['post_prefill_critical_path_ms']:.1f}")
        lines.append(f"{t}_layerwise_vs_whole_{n}={r['layerwise_vs_whole']:.3f}")
        lines.append(f"{t}_one_layer_transfer_ms_{n}={r['one_layer_transfer_ms']:.2f}")
    lines.append(f"{t}_fixed_request_ms={res['fixed_request_ms']:.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--transport", choices=("rdma", "tcp"), default="rdma")
    ap.add_argument("--tokens", default="1024,4096", help="request lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="requests per length and way")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="compute per layer (default: --compute-factor x one layer's "
                         "transfer, measured first)")
    ap.add_argument("--compute-factor", type=float, default=1.25)
    ap.add_argument("--tiny-tokens", type=int, default=BLOCK,
                    help="the request whose Send -> Success is the fixed cost")
    ap.add_argument("--sub-batch-mib", type=float, default=1.0,
                    help="decode's --verify-sub-batch-mib (1: a sub-batch a layer from "
                         "1,024 tokens up)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    from tests.host.test_engine_channel import attached_pair

    lengths = [int(n) for n in args.tokens.split(",")]
    config = model(args.layers, max(lengths))
    kv_per_token = block_bytes(config.target) * args.layers // BLOCK
    assert build_side_layout(config).kv_layers == tuple(range(args.layers))
    # --log-requests: decode's Success line times its check, prefill's says what its
    # final chunk wrote (a line per piece: not in the critical path but the last's).
    flags = [*SLOW_GUEST, "--send-wait-s", "30", "--verify-sub-batch-mib",
             f"{args.sub_batch_mib:g}", "--log-requests", "true"]
    started = time.monotonic()
    res: dict[str, Any] = {"transport": args.transport, "layers": args.layers,
                           "kv_bytes_per_token": kv_per_token, "repeat": args.repeat,
                           "sub_batch_mib": args.sub_batch_mib, "tiny_tokens": args.tiny_tokens,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="kvbeam-bench-layers-") as work:
        tmp = Path(work)
        tmp.chmod(0o700)
        cfg = write_config(tmp / "side.yaml", config)
        with attached_pair(tmp, cfg, flags, pushes="final",
                           transport=args.transport) as four:
            pair = Pair(*four)
            log(f"daemons and engines up in {time.monotonic() - started:.0f} s")
            # The pair's handshake, then decode's offers: not in a sample.
            pair.request(args.tiny_tokens, args.layers, 0.0, "whole", offer_s=2.0)
            tiny = [pair.request(args.tiny_tokens, args.layers, 0.0, "whole")
                    for _ in range(args.repeat)]
            res["fixed_runs_ms"] = [s.critical_ms for s in tiny]
            res["fixed_request_ms"] = med(res["fixed_runs_ms"])
            log(f"fixed cost: {res['fixed_runs_ms']}")
            res["rows"] = [measure(pair, n, args.layers, n * kv_per_token, args.repeat,
                                   args.compute_ms, args.compute_factor) for n in lengths]
    res["elapsed_s"] = time.monotonic() - started
    print(report(res), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float))
    log(f"done in {res['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
