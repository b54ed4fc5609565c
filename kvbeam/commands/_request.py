"""Shared pieces of the scheduler subcommands (reserve, send, status, abort, release)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from kvbeam.client import KvbeamClient, Status
from kvbeam.server.settings import add_auth_arguments, resolve_security


def add_common(parser: argparse.ArgumentParser, address_help: str) -> None:
    """--address, --request-id, --timeout, --json and the credential flags."""
    parser.add_argument("--address", required=True, help=address_help)
    parser.add_argument("--request-id", required=True, help="the request id (unique per pair)")
    parser.add_argument("--timeout", type=float, default=5.0, help="RPC deadline, s (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    add_auth_arguments(parser)


def add_indices(parser: argparse.ArgumentParser, whose: str) -> None:
    """--indices FILE.json: the engine's own index lists (docs/indices.md)."""
    parser.add_argument(
        "--indices", metavar="FILE.json",
        help=f"{whose} index lists the engine chose, a JSON object of kind -> list of ints, "
             '"draft.KIND" for the draft\'s own lists, e.g. {"KV_PAGES": [7, 2, 9], '
             '"SWA_RING_ROWS": [...], "REQ_SLOT": [3], "C128_STATE": [3]}; every kind the '
             "layout uses (docs/indices.md). Without it: slot-based lists")


def load_indices(path: str | None) -> dict[str, list[int]] | None:
    """The JSON object of ``--indices`` (None without the flag); SystemExit when malformed."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--indices {path}: {exc}") from None
    if not isinstance(data, dict) or not all(
            isinstance(v, list) and all(isinstance(i, int) for i in v) for v in data.values()):
        raise SystemExit(f"--indices {path}: a JSON object of kind name -> list of integers "
                         "is needed")
    return data


def open_client(args: argparse.Namespace) -> KvbeamClient:
    """A client to ``--address`` with the command's deadline and credentials."""
    return KvbeamClient(args.address, timeout=args.timeout, security=resolve_security(args))


def print_status(status: Status, as_json: bool) -> int:
    """Print a status; exit code 0 unless it is Failed.

    Text: the state, bytes done/total, the slot (decode's slot-based reservation's) and the
    peer on the first line; then the index lists' lengths, the verification and the
    timeline (each state entered, ms after the request was created), one line each.
    """
    if as_json:
        d = asdict(status)
        d["state"] = status.state.value
        d["reason"] = status.reason.value if status.reason else None
        d["lists"] = dict(status.lists)
        d["timeline"] = [[state.value, after] for state, after in status.timeline]
        json.dump(d, sys.stdout)
        sys.stdout.write("\n")
    else:
        slot = f" slot={status.slot}" if status.slot >= 0 else ""
        print(f"{status.request_id}: {status} bytes={status.bytes_done}/{status.bytes_total}"
              f"{slot} peer={status.peer}")
        if status.lists:
            skip = f" (kv_skip {status.kv_skip}: held by decode)" if status.kv_skip else ""
            print("  lists: " + " ".join(f"{k}={n}" for k, n in status.lists) + skip)
        if status.verification:
            print(f"  verification: {status.verification}")
        if status.timeline:
            print("  timeline: " + " -> ".join(f"{state.value} {after * 1000:.1f} ms"
                                               for state, after in status.timeline))
    return 1 if status.terminal and status.reason is not None else 0
