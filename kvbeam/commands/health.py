"""``kvbeam health``: ask a daemon's gRPC health service (container HEALTHCHECKs use it)."""

from __future__ import annotations

import argparse
import sys

from kvbeam.auth import Security
from kvbeam.control_channel import serving
from kvbeam.errors import ConfigError
from kvbeam.server.settings import add_auth_arguments, resolve_security

NAME = "health"
HELP = "exit 0 when a daemon's gRPC health service answers SERVING (for HEALTHCHECKs)"
DESCRIPTION = """\
Call grpc.health.v1.Health/Check (service "") on the daemon's control address.
A daemon answers SERVING once its pools are allocated, its transport is open and
its control server is up; it turns NOT_SERVING while it shuts down.

A daemon that requires mTLS needs the same --tls-* flags (or KVBEAM_TLS_*
variables) as any client; a token is not needed (the health service is exempt).

exit codes: 0 SERVING, 1 anything else (not listening, NOT_SERVING, deadline,
TLS refused), 2 bad flags (e.g. an unreadable certificate file).

examples:
  kvbeam health 127.0.0.1:50051            # the image's HEALTHCHECK
  kvbeam health --tls-cert tls.crt --tls-key tls.key --tls-ca ca.crt \\
      decode-0.kvbeam-decode:50052       # a Kubernetes exec probe with mTLS
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam health``."""
    parser.add_argument("address", help="control address HOST:PORT of a prefill or decode daemon")
    parser.add_argument("--timeout", type=float, default=3.0, help="RPC deadline, s (default 3)")
    parser.add_argument("--quiet", action="store_true", help="print nothing, only the exit code")
    add_auth_arguments(parser)


def check(address: str, timeout: float, security: Security | None = None) -> bool:
    """True when ``address`` answers SERVING within ``timeout`` seconds.

    No numpy and no torch are imported, so a HEALTHCHECK stays cheap even on a slow
    (emulated) CPU. ``security``: the credentials to dial with (mTLS); plain otherwise.
    """
    with (security or Security()).channel(address) as channel:
        return serving(channel, timeout)


def run(args: argparse.Namespace) -> int:
    """Check once and print the verdict."""
    try:
        security = resolve_security(args)
    except ConfigError as exc:
        print(f"kvbeam health: {exc}", file=sys.stderr)
        return 2
    ok = check(args.address, args.timeout, security)
    if not args.quiet:
        print(f"{args.address}: {'SERVING' if ok else 'not serving (or not reachable)'}",
              file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main() -> int:
    """``python -m kvbeam.commands.health ADDRESS``: the check without loading the full CLI."""
    parser = argparse.ArgumentParser(prog="kvbeam health", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
