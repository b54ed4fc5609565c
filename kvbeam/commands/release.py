"""``kvbeam release``: hand a finished request over to the engine, freeing decode's slot."""

from __future__ import annotations

import argparse

from kvbeam.commands._request import add_common, open_client, print_status

NAME = "release"
HELP = "scheduler: release a Success request's slot on decode (the engine took over)"
DESCRIPTION = """\
After Success decode keeps the slot (its KV is the engine's input) until Release
or the hand-off lease (--handoff-lease-s) expires.

exit codes: 0 released, 2 not Success, unknown request or refused.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam release``."""
    add_common(parser, "decode control address HOST:PORT")


def run(args: argparse.Namespace) -> int:
    """Release and print."""
    with open_client(args) as client:
        print_status(client.release(args.request_id), args.json)
    return 0
