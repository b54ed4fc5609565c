"""``kvbeam drive``: run requests through running prefill/decode daemons (a reference scheduler)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict

from kvbeam.scheduler import drive, format_table
from kvbeam.server.settings import add_auth_arguments, resolve_security

NAME = "drive"
HELP = "run N requests through running daemons; exit 0 only if all reach Success"
DESCRIPTION = """\
Act as the scheduler: for each request Reserve on decode, Send on prefill, wait for
decode's terminal state, Release. Decode reports Success only after the completion
proved every byte landed and (integrity on) the XXH3-128 digests of every moved
buffer matched prefill's. Prints a per-request table (or --json).

--require-verified also demands that decode's Success detail says the XXH3-128
digests were checked (integrity on at both daemons): a Success with integrity off
counts as a failure then.

Several daemons: repeat --prefill/--decode, comma-separate them, or give
dns:HOST:PORT (every A/AAAA record of HOST: a Kubernetes headless Service). Each
request then goes to the decode with the most free slots (from its Heartbeat) and
the least loaded prefill; a request whose daemon died, restarted or lost its link
is resent elsewhere (--max-attempts in all), and the table counts the resends.

exit codes: 0 all Success (and verified, with --require-verified), 1 some request
failed (or was not verified), 2 bad arguments.

example:
  kvbeam drive --prefill 127.0.0.1:50051 --decode 127.0.0.1:50052 --requests 8
  kvbeam drive --prefill dns:kvbeam-prefill:50051 --decode 10.0.0.5:50052,10.0.0.6:50052
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam drive``."""
    parser.add_argument("--prefill", required=True, action="append",
                        help="prefill control address HOST:PORT or dns:HOST:PORT; repeat or "
                             "comma-separate for several")
    parser.add_argument("--decode", required=True, action="append",
                        help="decode control address(es), like --prefill")
    parser.add_argument("--requests", type=int, default=8, help="number of requests (default 8)")
    parser.add_argument("--seq-lens", default="",
                        help="comma-separated lengths, cycled (default: random 1..--max-len)")
    parser.add_argument("--max-len", type=int, default=8192,
                        help="longest random length (default 8192)")
    parser.add_argument("--source-slots", type=int, default=8,
                        help="prefill slots to use, round-robin (default 8)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, s")
    parser.add_argument("--seed", type=int, default=0, help="random seed for lengths")
    parser.add_argument("--prefix", default="req", help="request id prefix (ids must be unique)")
    parser.add_argument("--max-attempts", type=int, default=4,
                        help="several daemons: tries per request, resends after a daemon "
                             "failure included (default 4)")
    parser.add_argument("--json", action="store_true", help="print JSON results")
    parser.add_argument("--require-verified", action="store_true",
                        help="fail unless decode verified every request's XXH3-128 digests")
    add_auth_arguments(parser)


def seq_lens_from(args: argparse.Namespace) -> list[int]:
    """The request lengths asked for."""
    if args.seq_lens:
        base = [int(x) for x in args.seq_lens.split(",") if x.strip()]
        return [base[i % len(base)] for i in range(args.requests)]
    rng = random.Random(args.seed)
    return [rng.randint(1, args.max_len) for _ in range(args.requests)]


def run(args: argparse.Namespace) -> int:
    """Drive and report."""
    results = drive(args.prefill, args.decode, seq_lens_from(args),
                    source_slots=args.source_slots, concurrency=args.concurrency,
                    timeout=args.timeout, prefix=args.prefix,
                    security=resolve_security(args), max_attempts=args.max_attempts)
    if args.json:
        json.dump([asdict(r) | {"ok": r.ok, "verified": r.verified} for r in results],
                  sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_table(results))
    unverified = [r.request_id for r in results if r.ok and not r.verified]
    if args.require_verified and unverified:
        print(f"kvbeam drive: {len(unverified)} request(s) reached Success without XXH3-128 "
              f"verification ({', '.join(unverified[:5])}): turn integrity on at both daemons "
              "(KVBEAM_INTEGRITY=true, the default)", file=sys.stderr)
        return 1
    return 0 if all(r.ok for r in results) else 1
