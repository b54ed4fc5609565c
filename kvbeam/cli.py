"""The ``kvbeam`` console script: argparse with one module per subcommand.

Each module in :mod:`kvbeam.commands` exposes ``NAME``, ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). Modules must
not import torch at import time: ``kvbeam --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from kvbeam import __version__
from kvbeam.errors import KvbeamError

COMMAND_MODULES = ("plan", "check", "prefill", "decode", "demo", "drive", "reserve", "send",
                   "status", "abort", "release", "health")
#: The commands that run a daemon.
DAEMON_COMMANDS = frozenset({"prefill", "decode"})


def one_blas_thread_for_daemons(argv: Sequence[str]) -> None:
    """A daemon's numpy does no BLAS work, yet OpenBLAS starts a thread per core (up to
    its build's 64) when numpy is imported: idle threads in every daemon of a large host.
    For ``kvbeam prefill``/``decode`` it gets one, unless ``OPENBLAS_NUM_THREADS`` is
    set. Must run before numpy is imported (the command modules import it)."""
    command = next((a for a in argv if a in COMMAND_MODULES), "")
    if command in DAEMON_COMMANDS:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

def _load_commands() -> list[ModuleType]:
    return [importlib.import_module(f"kvbeam.commands.{name}") for name in COMMAND_MODULES]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="kvbeam",
        description="KV-state transport for prefill/decode disaggregated LLM serving.",
        epilog="Run 'kvbeam COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"kvbeam {__version__}")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _load_commands():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run the subcommand, map kvbeam errors to exit code 2."""
    one_blas_thread_for_daemons(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code: int = args._run(args)
    except KvbeamError as exc:
        # The CLI's own output: always on stderr, whatever logging is configured to do.
        print(f"kvbeam: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
