"""``kvbeam send``: Send (a chunk of) a request from a prefill daemon."""

from __future__ import annotations

import argparse

from kvbeam.commands._request import (
    add_common,
    add_indices,
    load_indices,
    open_client,
    print_status,
)

NAME = "send"
HELP = "scheduler: send (a chunk of) a request from a prefill daemon to decode"
DESCRIPTION = """\
Send on prefill: prefill handshakes with the decode daemon if needed, asks it where
to write, plans and writes. Without --chunk the whole request goes at once (final);
with --chunk START:END (repeatable) and --not-final only those tokens' KV pages go
now; the final send moves the rest plus the state components and the completion.
With --indices the engine's own source lists of the whole request are checked and
used instead of --source-slot's (give them with the first chunk).

exit codes: 0 queued (or, with --wait, Success), 1 Failed, 2 refused.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam send``."""
    add_common(parser, "prefill control address HOST:PORT")
    parser.add_argument("--source-slot", type=int, default=-1,
                        help="prefill request slot (needed without --indices)")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens in the request")
    parser.add_argument("--decode", required=True, help="decode control address HOST:PORT")
    parser.add_argument("--chunk", action="append", default=[], metavar="START:END",
                        help="token range of this chunk (repeatable); prefill writes the "
                        "whole KV pages up to the furthest END, a page filled in part "
                        "with a later chunk")
    parser.add_argument("--not-final", action="store_true", help="more chunks follow")
    add_indices(parser, "prefill's source")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="wait up to this many seconds for the terminal state")


def run(args: argparse.Namespace) -> int:
    """Send and print the status."""
    indices = load_indices(args.indices)
    if indices is None and args.source_slot < 0:
        raise SystemExit("kvbeam send: --source-slot or --indices is needed")
    chunks = []
    for text in args.chunk:
        start, _, end = text.partition(":")
        chunks.append((int(start), int(end)))
    with open_client(args) as client:
        status = client.send(args.request_id, args.source_slot, args.seq_len, args.decode,
                             final=not args.not_final, chunks=chunks, indices=indices)
        if args.wait > 0:
            status = client.wait(args.request_id, args.wait)
    return print_status(status, args.json)
