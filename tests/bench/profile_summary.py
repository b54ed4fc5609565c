"""Summarise py-spy raw profiles of the daemons (``bench_request --profile``) by phase.

    python -m tests.bench.profile_summary DIR [--rate 250]

Each sample (a thread holding the GIL) is charged to the first phase whose marker
appears in its stack, leaf first, so e.g. a gRPC client call made while planning
counts as gRPC. Prints Python CPU ms per request for each daemon and phase.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

#: (phase, regex on one frame), checked leaf to root per sample; first hit wins.
PHASES: list[tuple[str, str]] = [
    ("logging", r"\(logging/"),
    ("digest (XXH3-128)", r"request_digests"),
    ("gRPC client call", r"grpc/_channel\.py"),
    ("transport write (checks, keys, WR arrays)",
     r"(VerbsLink|TcpLink)\.write|prepare \(|build \("),
    ("post/poll (progress thread)", r"VerbsTransport\._|VerbsLink\.service|TcpLink\._"),
    ("plan (indices, pages, blocks)", r"build_plan|_select_pages|request_indices|indices_from|"
                                      r"indices_to|Runs\.|coalesce"),
    ("status table / watch", r"lifecycle\.py|TransferTable"),
    ("engine channel (frames, pushes, attach loop)",
     r"engine_channel\.py|engine_frames\.py|server/attach\.py|engine/channel\.py"),
    ("RPC handlers", r"rpc_status\.py|servicer\.py|decode\.py|prefill\.py"),
    ("gRPC server machinery", r"grpc/_server\.py|grpc/_common\.py|grpc/_utilities"),
    ("thread hand-offs (locks, queues, pools)",
     r"(Condition|Event|Semaphore|ThreadPoolExecutor|_WorkItem|EventQueue)\.|_worker \("),
    ("periodic (sweep)", r"_sweep|periodic"),
]


def summarise(path: Path) -> collections.Counter[str]:
    """Samples per phase in one py-spy raw file."""
    out: collections.Counter[str] = collections.Counter()
    compiled = [(name, re.compile(rx)) for name, rx in PHASES]
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        phase = "other"
        for frame in reversed(frames):
            hit = next((name for name, rx in compiled if rx.search(frame)), None)
            if hit:
                phase = hit
                break
        out[phase] += int(count)
    return out


def main() -> None:
    """Print the table."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--rate", type=float, default=250.0, help="py-spy samples per second")
    args = p.parse_args()
    d = Path(args.dir)
    info = (d / "requests.txt").read_text().strip()
    nreq = int(info.split()[0])
    print(f"{info}; Python CPU (GIL held) ms per request, by phase")
    for daemon in ("prefill", "decode", "prefill-engine"):
        if not (d / f"{daemon}.txt").exists():
            continue
        counts = summarise(d / f"{daemon}.txt")
        total = sum(counts.values())
        print(f"\n{daemon}: {total / args.rate / nreq * 1e3:.2f} ms per request")
        for phase, n in counts.most_common():
            print(f"  {phase:<44} {n / args.rate / nreq * 1e3:7.2f} ms  {100 * n / total:5.1f}%")


if __name__ == "__main__":
    main()
