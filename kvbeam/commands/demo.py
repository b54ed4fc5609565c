"""``kvbeam demo``: start a prefill and a decode daemon, move requests, show the table."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

from kvbeam.auth import Security
from kvbeam.procs import start_daemon
from kvbeam.scheduler import drive, format_table
from kvbeam.transport.factory import pick_rdma_device

NAME = "demo"
HELP = "start prefill + decode daemons here, move a handful of requests, print the table"
DESCRIPTION = """\
Start a prefill and a decode daemon as separate processes (pools from
docker/config/{prefill,decode}.yaml, filled with distinct patterns), run requests
of different lengths through the scheduler API (Reserve, Send, wait, Release),
and print a per-request table and the transport used. Decode verifies every moved
buffer with CRC32C against prefill's digests before it reports Success.

--transport auto (default): RDMA when a device exists; otherwise the demo re-runs
itself inside the soft-RoCE harness (a qemu guest with rdma_rxe; a minute or two
to boot here) with --transport rdma. --transport tcp: the quick run without RDMA.

The daemons listen on loopback and require a fresh random shared token (passed to
them in KVBEAM_AUTH_TOKEN), so the demo exercises the authenticated control plane.

exit codes: 0 all requests Success, 1 otherwise.
"""

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
DEFAULT_LENS = "128,1000,4096,8192,32768,333"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam demo``."""
    parser.add_argument("--transport", choices=["auto", "rdma", "tcp"], default="auto",
                        help="data plane (default auto; see above)")
    parser.add_argument("--prefill-config", default=str(REPO / "docker/config/prefill.yaml"))
    parser.add_argument("--decode-config", default=str(REPO / "docker/config/decode.yaml"))
    parser.add_argument("--seq-lens", default=DEFAULT_LENS,
                        help=f"comma-separated request lengths (default {DEFAULT_LENS})")
    parser.add_argument("--concurrency", type=int, default=3)


def _in_harness(args: argparse.Namespace) -> int:
    script = REPO / "tests/softroce/run_rdma_suite.sh"
    if not script.exists():
        print("kvbeam demo: no RDMA device here and no soft-RoCE harness "
              f"({script} is missing); run `kvbeam demo --transport tcp`", file=sys.stderr)
        return 1
    inner = [sys.executable, "-m", "kvbeam.cli", "demo", "--transport", "rdma",
             "--prefill-config", args.prefill_config, "--decode-config", args.decode_config,
             "--seq-lens", args.seq_lens, "--concurrency", str(args.concurrency)]
    print("kvbeam demo: no RDMA device on this host: running inside the soft-RoCE harness "
          "(qemu guest with rdma_rxe; booting takes a minute or two)...", flush=True)
    return subprocess.call(["bash", str(script), "--cmd", shlex.join(inner)], cwd=REPO)


def run(args: argparse.Namespace) -> int:
    """Run the demo."""
    if args.transport == "auto":
        if pick_rdma_device() is None:
            return _in_harness(args)
        args.transport = "rdma"
    if args.transport == "tcp":
        print("kvbeam demo: TCP transport (no RDMA): the quick run; RDMA is the real path",
              flush=True)
    common = ["--transport", args.transport, "--log-level", "WARNING"]
    # A fresh token per run: the daemons require it, only this process knows it.
    security = Security(token=secrets.token_urlsafe(32))
    env = {"PYTHONUNBUFFERED": "1", "KVBEAM_AUTH_TOKEN": security.token,
           **({} if "KVBEAM_RDMA_DEVICE" not in os.environ else
              {"KVBEAM_RDMA_DEVICE": os.environ["KVBEAM_RDMA_DEVICE"]})}
    print("starting decode and prefill daemons...", flush=True)
    decode = start_daemon("decode", args.decode_config, extra=[*common, "--fill-seed", "2"],
                          env=env, security=security)
    try:
        prefill = start_daemon("prefill", args.prefill_config,
                               extra=[*common, "--fill-seed", "1"], env=env,
                               security=security)
        try:
            print(f"prefill {prefill.address}, decode {decode.address}, "
                  f"transport {prefill.transport}", flush=True)
            lens = [int(x) for x in args.seq_lens.split(",") if x.strip()]
            results = drive(prefill.address, decode.address, lens, source_slots=8,
                            concurrency=args.concurrency, prefix="demo", security=security)
            print(format_table(results, prefill.transport))
            return 0 if all(r.ok for r in results) else 1
        finally:
            prefill.stop()
    finally:
        decode.stop()
