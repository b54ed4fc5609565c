"""``kvbeam reserve``: Reserve a slot on a decode daemon."""

from __future__ import annotations

import argparse
import json

from kvbeam.commands._request import add_common, add_indices, load_indices, open_client

NAME = "reserve"
HELP = "scheduler: reserve a slot for a request on a decode daemon"
DESCRIPTION = """\
Reserve on decode: decode picks a request slot and the destination indices of
every index kind, and holds them under a lease (its Bootstrapping deadline) until
prefill begins writing. RESOURCE_EXHAUSTED (exit 3) when every slot is held.
With --indices the engine's own destination lists are checked and used instead
(the reservation still takes one of the request slots; its slot prints as -1).

exit codes: 0 reserved, 2 refused (bad request, duplicate id), 3 no free slot.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam reserve``."""
    add_common(parser, "decode control address HOST:PORT")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens to move")
    parser.add_argument("--prefill", required=True,
                        help="the prefill daemon's control address (only it may write)")
    add_indices(parser, "decode's destination")


def run(args: argparse.Namespace) -> int:
    """Reserve and print the slot."""
    from kvbeam.errors import Busy

    with open_client(args) as client:
        try:
            r = client.reserve(args.request_id, args.seq_len, args.prefill,
                               indices=load_indices(args.indices))
        except Busy as exc:
            print(f"kvbeam reserve: {exc}")
            return 3
    if args.json:
        print(json.dumps({"request_id": r.request_id, "slot": r.slot, "lease_s": r.lease_s,
                          "decode_instance": r.decode_instance,
                          "indices": {k.value: len(v) for k, v in r.indices.items()},
                          "draft_indices": {k.value: len(v) for k, v in r.draft.items()}}))
    else:
        print(f"{r.request_id}: slot {r.slot}, lease {r.lease_s:g} s, "
              + ", ".join(f"{k.value}={len(v)}" for k, v in r.indices.items()))
    return 0
