"""``kvbeam decode``: run the decode daemon."""

from __future__ import annotations

import argparse
import logging

from kvbeam.server.main import run_daemon
from kvbeam.server.settings import add_daemon_arguments, env_help, resolve

NAME = "decode"
HELP = "run the decode daemon (serves Reserve; receives KV from prefill daemons)"
DESCRIPTION = f"""\
Run the decode daemon: allocate the target and draft pools from --config, check
them (refusing to start with sglang's error when target and draft disagree), open
the transport (the RDMA device given or found; TCP only when none exists), and
serve the kvbeam.v1 control API and the gRPC health service on --listen.
SIGTERM or SIGINT shut it down: in-flight transfers fail with reason shutdown.

{env_help()}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """All daemon options."""
    add_daemon_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Resolve settings and serve until signalled."""
    settings = resolve(NAME, args)
    logging.getLogger().setLevel(settings.log_level)
    return run_daemon(settings)
