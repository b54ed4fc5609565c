"""What ``kvbeam prefill`` and ``kvbeam decode`` share: options, description, run."""

from __future__ import annotations

import argparse

from kvbeam.server.settings import add_daemon_arguments, env_help, resolve


def description(role: str) -> str:
    """The --help text of a daemon command."""
    return f"""\
Run the {role} daemon: allocate the target and draft pools from --config (or, with
--pools engine, wait for an inference engine to attach its own memory on
--attach-socket: NOT_SERVING and transfers refused until then; docs/engine.md), check
them (refusing to start with sglang's error when target and draft disagree), open
the transport (the RDMA device given or found; TCP only when none exists, logged
as a warning), and serve the kvbeam.v1 control API and the gRPC health service on
--listen. SIGTERM or SIGINT shut it down: in-flight transfers fail with reason
shutdown and nothing stays registered. Prints one line "kvbeam {role} listening on
HOST:PORT instance ID transport KIND" on stdout once serving, followed by
" metrics HOST:PORT" when --metrics serves Prometheus metrics. ID is the daemon's
instance id, the one peers see, until an engine attaches new memory after a detach
(a new id, logged with both). Each ended transfer logs one INFO line
(--log-ends-per-s); --log-requests adds a line per step.

{env_help()}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """All daemon options."""
    add_daemon_arguments(parser)


def run_role(role: str, args: argparse.Namespace) -> int:
    """Resolve settings and serve until signalled."""
    from kvbeam.logs import configure
    from kvbeam.server.main import run_daemon

    settings = resolve(role, args)
    configure(settings.log_level, settings.log_format, role,
              log_requests=settings.log_requests)
    return run_daemon(settings)
