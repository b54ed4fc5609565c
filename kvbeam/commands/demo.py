"""``kvbeam demo``: the reference engines through two daemons (default), or transport only."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvbeam.auth import Security
from kvbeam.procs import start_daemon
from kvbeam.scheduler import drive, format_table
from kvbeam.transport.factory import pick_rdma_device

if TYPE_CHECKING:
    from kvbeam.pools.spec import SideConfig

NAME = "demo"
HELP = "prefill with the reference engine, move its state through two daemons, decode, compare"
DESCRIPTION = """\
--pools engine (default): the reference engines end to end (docs/refengine.md).
Start a prefill and a decode daemon as separate processes in --pools engine mode;
each reference engine (a small DeepSeek-V4-shaped torch model, random weights
from a fixed seed) attaches its memfd pools to its daemon. Each prompt is
prefilled in the prefill engine, its state moved by the daemons from the prefill
engine's pages to the decode engine's own pages (decode's pools start as random
bytes), and the decode engine continues -k tokens from the moved state alone. The
table shows, per request, the prompt length, the continued tokens beside those of
one colocated engine that ran prompt and continuation without any transfer,
whether they are equal (tokens, logits, draft proposals), the bytes moved and the
Send->Success time. The config is refengine's tiny one (--paged, --no-draft) or
--config FILE (one side YAML for both engines).

--pools own: the transport-only demo. The daemons allocate their own pools (from
docker/config/{prefill,decode}.yaml, filled with distinct patterns), run requests
of different lengths through the scheduler API (Reserve, Send, wait, Release),
and print a per-request table and the transport used.

Either way decode verifies every moved buffer with XXH3-128 against prefill's
digests before it reports Success.

--transport auto (default): RDMA when a device exists; otherwise the demo re-runs
itself inside the soft-RoCE harness (a qemu guest with rdma_rxe; a minute or two
to boot here) with --transport rdma. --transport tcp: the quick run without RDMA.

The daemons listen on loopback and require a fresh random shared token (passed to
them in KVBEAM_AUTH_TOKEN), so the demo exercises the authenticated control plane.

exit codes: 0 all requests Success (and, --pools engine, every continuation
equal), 1 otherwise.
"""

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
DEFAULT_LENS = "128,1000,4096,8192,32768,333"
#: 128 ends on a page, window and C128 boundary of the tiny config at once; 130 on none
#: (short: under TCG, in the soft-RoCE guest, a 250-token prompt takes about a minute).
DEFAULT_PROMPTS = "128,130"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam demo``."""
    parser.add_argument("--transport", choices=["auto", "rdma", "tcp"], default="auto",
                        help="data plane (default auto; see above)")
    parser.add_argument("--pools", choices=["engine", "own"], default="engine",
                        help="engine: the reference engines (default); own: transport only")
    engine = parser.add_argument_group("--pools engine")
    engine.add_argument("--prompt-lens", default=DEFAULT_PROMPTS,
                        help=f"comma-separated prompt lengths (default {DEFAULT_PROMPTS})")
    engine.add_argument("-k", type=int, default=8, help="tokens to continue (default 8)")
    engine.add_argument("--paged", action="store_true", help="paged SWA instead of unified")
    engine.add_argument("--no-draft", action="store_true", help="no NextN draft")
    engine.add_argument("--config", default="",
                        help="a side YAML for both engines instead of the tiny config")
    engine.add_argument("--device", default="", metavar="DEVICE",
                        help="the engines' KV in ordinary tensors on DEVICE (cuda, cpu), "
                             "staged through host buffers the engines attach (docs/gpu.md); "
                             "default: the engines compute in their attached memfds")
    own = parser.add_argument_group("--pools own")
    own.add_argument("--prefill-config", default=str(REPO / "docker/config/prefill.yaml"))
    own.add_argument("--decode-config", default=str(REPO / "docker/config/decode.yaml"))
    own.add_argument("--seq-lens", default=DEFAULT_LENS,
                     help=f"comma-separated request lengths (default {DEFAULT_LENS})")
    own.add_argument("--concurrency", type=int, default=3)


def _in_harness(args: argparse.Namespace) -> int:
    script = REPO / "tests/softroce/run_rdma_suite.sh"
    if not script.exists():
        print("kvbeam demo: no RDMA device here and no soft-RoCE harness "
              f"({script} is missing); run `kvbeam demo --transport tcp`", file=sys.stderr)
        return 1
    inner = [sys.executable, "-m", "kvbeam.cli", "demo", "--transport", "rdma",
             "--pools", args.pools, "--prefill-config", args.prefill_config,
             "--decode-config", args.decode_config, "--seq-lens", args.seq_lens,
             "--concurrency", str(args.concurrency), "--prompt-lens", args.prompt_lens,
             "-k", str(args.k), *(["--paged"] if args.paged else []),
             *(["--no-draft"] if args.no_draft else []),
             *(["--config", args.config] if args.config else []),
             *(["--device", args.device] if args.device else [])]
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
    # A fresh token per run: the daemons require it, only this process knows it.
    security = Security(token=secrets.token_urlsafe(32))
    env = {"PYTHONUNBUFFERED": "1", "KVBEAM_AUTH_TOKEN": security.token,
           **({} if "KVBEAM_RDMA_DEVICE" not in os.environ else
              {"KVBEAM_RDMA_DEVICE": os.environ["KVBEAM_RDMA_DEVICE"]})}
    if args.pools == "engine":
        return run_engines(args, env, security)
    common = ["--transport", args.transport, "--log-level", "WARNING"]
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


def _engine_config(args: argparse.Namespace) -> SideConfig:
    import yaml

    from kvbeam.refengine.configs import tiny_config

    if args.config:
        with open(args.config) as f:
            return SideConfig.from_mapping(yaml.safe_load(f), args.config)
    return tiny_config(unified=not args.paged, draft=not args.no_draft)


def run_engines(args: argparse.Namespace, env: dict[str, str], security: Security) -> int:
    """``--pools engine``: the reference engines through two ``--pools engine`` daemons."""
    # Imported here: torch loads only for this demo, not for every kvbeam command.
    from kvbeam.refengine.served import ServedPair, Staging, format_rows, run_prompts

    config = _engine_config(args)
    lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
    print(f"starting decode and prefill daemons (--pools engine), reference engines on "
          f"{config.source}...", flush=True)
    with ServedPair(config, transport=args.transport, extra=("--log-level", "WARNING"),
                    env=env, security=security, prefix="demo",
                    staging=Staging(args.device) if args.device else None) as pair:
        how = f"KV on {args.device}, staged" if args.device else "KV in the attached memfds"
        print(f"prefill {pair.prefill.address}, decode {pair.decode.address}, transport "
              f"{pair.prefill.transport}; engines attached ({how}); {len(lens)} prompt(s), "
              f"{args.k} tokens each", flush=True)
        rows = run_prompts(pair, lens, args.k)
        print(format_rows(rows, pair.prefill.transport))
    return 0 if rows and all(r.comparison.equal and r.record.ok for r in rows) else 1
