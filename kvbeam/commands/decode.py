"""``kvbeam decode``: run the decode daemon."""

from __future__ import annotations

import argparse

from kvbeam.commands._daemon import add_arguments, description, run_role

NAME = "decode"
HELP = "run the decode daemon (serves Reserve; receives KV from prefill daemons)"
DESCRIPTION = description(NAME)
__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """Serve until signalled."""
    return run_role(NAME, args)
