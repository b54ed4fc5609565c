"""``kvbeam check PREFILL.yaml DECODE.yaml``: the handshake's verification, offline.

Loads both side configs, lays out their pools, sends each layout through the
wire codec (so what is compared is exactly what a handshake would compare) and
runs :func:`kvbeam.pools.checks.compare_sides`, which includes each side's own
target/draft checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvbeam.errors import Difference, KvbeamError

NAME = "check"
HELP = "verify offline that a prefill and a decode config are compatible"
DESCRIPTION = """\
Verify offline that a prefill and a decode side config are compatible: the same
checks two daemons run at their handshake (each side's target/draft pools with
sglang's checks, then prefill against decode). Every difference is listed.

exit codes:
  0  compatible
  1  incompatible: every difference is printed
  2  a config cannot be used (unreadable file, invalid YAML, invalid field)
"""

EXIT_COMPATIBLE = 0
EXIT_INCOMPATIBLE = 1
EXIT_CONFIG_ERROR = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``PREFILL``, ``DECODE`` and ``--json``."""
    parser.add_argument("prefill", metavar="PREFILL.yaml", help="the prefill side's config")
    parser.add_argument("decode", metavar="DECODE.yaml", help="the decode side's config")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: compatible, differences (field, side, "
                             "values, message), or error")


def _difference_json(d: Difference) -> dict[str, Any]:
    return {"field": d.field, "side": d.side, "values": dict(d.values), "message": d.message}


def verify(prefill_path: str, decode_path: str) -> list[Difference]:
    """Every difference between two side configs, exactly as a handshake computes it.

    Raises:
        ConfigError: a config cannot be read or built.
        ProtocolError: a layout cannot be carried by the wire protocol.
    """
    # Imported here so that `kvbeam --help` does not load the pools and protobuf.
    from kvbeam.pools.checks import compare_sides
    from kvbeam.pools.layout import build_side_layout
    from kvbeam.pools.spec import load_side_config
    from kvbeam.proto.layout_codec import layout_from_proto, layout_to_proto

    layouts = []
    for path in (prefill_path, decode_path):
        layout = build_side_layout(load_side_config(path))
        layouts.append(layout_from_proto(layout_to_proto(layout), f"{path}: metadata"))
    return compare_sides(layouts[0], layouts[1])


def run(args: argparse.Namespace) -> int:
    """Print the verdict; return 0 compatible, 1 incompatible (2 comes from ConfigError)."""
    try:
        diffs = verify(args.prefill, args.decode)
    except KvbeamError as exc:
        if not args.json:
            raise  # kvbeam.cli logs it and exits 2
        print(json.dumps({"compatible": None, "prefill": args.prefill, "decode": args.decode,
                          "error": str(exc)}, indent=2))
        return EXIT_CONFIG_ERROR
    return print_verdict(args.prefill, args.decode, diffs, as_json=args.json)


def print_verdict(prefill_path: str, decode_path: str, diffs: list[Difference], *,
                  as_json: bool) -> int:
    """Print :func:`verify`'s verdict (a table, or one JSON object); return the exit code.

    ``kvbeam plan`` prints its refusal with this too, so both commands word it alike.
    """
    if as_json:
        print(json.dumps({"compatible": not diffs, "prefill": prefill_path,
                          "decode": decode_path,
                          "differences": [_difference_json(d) for d in diffs]}, indent=2))
    elif diffs:
        print(f"INCOMPATIBLE: {prefill_path} (prefill) and {decode_path} (decode): "
              f"{len(diffs)} difference(s)")
        for d in diffs:
            values = ", ".join(f"{party}={value}" for party, value in d.values)
            print(f"  - {d.field} [{d.side}]: {d.message}")
            if values and values not in d.message:
                print(f"      ({values})")
    else:
        print(f"compatible: {prefill_path} (prefill) and {decode_path} (decode)")
    sys.stdout.flush()
    return EXIT_INCOMPATIBLE if diffs else EXIT_COMPATIBLE
