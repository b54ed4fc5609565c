"""``kvbeam status``: a request's state on either daemon."""

from __future__ import annotations

import argparse

from kvbeam.commands._request import add_common, open_client, print_status

NAME = "status"
HELP = "scheduler: show (or --watch) a request's state on a prefill or decode daemon"
DESCRIPTION = """\
States: Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed(reason, detail).
--watch streams every change (WatchStatus) until the request ends or --watch seconds pass.
Each status also shows what the request moves, from its plan, on that daemon: bytes done
of those planned (prefill: written of posted; decode: landed of reserved), each index
list's length, how its bytes are (or were) verified, and when it entered each state (ms
after it was created there); a daemon keeps them for its last 4096 ended requests.

exit codes: 0 (not Failed), 1 Failed, 2 unknown request or refused.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam status``."""
    add_common(parser, "control address of either daemon HOST:PORT")
    parser.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                        help="stream state changes for up to SECONDS")


def run(args: argparse.Namespace) -> int:
    """Print the status (or each change)."""
    with open_client(args) as client:
        status = client.status(args.request_id)
        if args.watch > 0:
            code = 0
            for status in client.watch(args.request_id, args.watch):
                code = print_status(status, args.json)
            return code
    return print_status(status, args.json)
