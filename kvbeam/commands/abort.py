"""``kvbeam abort``: abort a request on either daemon (propagated to the peer)."""

from __future__ import annotations

import argparse

from kvbeam.commands._request import add_common, open_client, print_status

NAME = "abort"
HELP = "scheduler: abort a request on either daemon; the peer is told"
DESCRIPTION = """\
Abort fails the request (reason aborted) and propagates to the peer daemon. On
decode the slot is freed once prefill confirmed none of its writes is in flight
(or the link to prefill was torn down); on prefill the request ends only after its
in-flight writes drained.

exit codes: 0 aborted (or already ended), 2 unknown request or refused.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam abort``."""
    add_common(parser, "control address of either daemon HOST:PORT")
    parser.add_argument("--detail", default="aborted by the scheduler", help="reason text")


def run(args: argparse.Namespace) -> int:
    """Abort and print the resulting status."""
    with open_client(args) as client:
        print_status(client.abort(args.request_id, args.detail), args.json)
    return 0
