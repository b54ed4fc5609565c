"""A peer's claimed control address is bound to what authenticated it (issue 22, item 5).

Prefill dials decode for the handshake and tells it, in its SideInfo, the control
address decode should call back (Offers, Aborts, heartbeats) and by which decode
recognises it: a reservation names prefill by that address, and a handshake from the
same address with a new instance id is a restart that fails the old instance's
requests. So a second authenticated caller claiming the real prefill's address must
be refused, naming both addresses, and the real prefill's live requests must not be
touched: under a shared token its address must be where it calls from, under mTLS
its certificate must name the address's host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import run_request
from kvbeam.states import TransferState
from tests.control_helpers import free_port
from tests.daemon_helpers import start
from tests.tls_helpers import Pki

SEQ = 2000


@contextmanager
def _daemons(*specs: tuple[str, list[str], str, Security]) -> Iterator[list[DaemonProcess]]:
    """Daemons (role, flags, listen, readiness credentials), all stopped afterwards."""
    with ExitStack() as stack:
        out = []
        for role, flags, listen, sec in specs:
            daemon = start(role, extra=flags, listen=listen, security=sec)
            stack.callback(daemon.stop)
            out.append(daemon)
        yield out


def _impersonation_is_refused(p: KvbeamClient, d: KvbeamClient, rogue: KvbeamClient,
                              real_prefill: str, rogue_dials: str, caller: str) -> None:
    """The real prefill works, a rogue prefill claiming its address is refused, and the
    real prefill's live request is untouched and completes afterwards."""
    warm = run_request(p, d, "ident-warm", SEQ, 0)
    assert warm.ok, warm  # decode knows the real prefill now (a connection, a link)
    d.reserve("ident-live", SEQ, real_prefill)  # a live request of the real prefill

    rogue.send("ident-rogue", 1, SEQ, rogue_dials)  # its handshake claims real_prefill
    refused = rogue.wait("ident-rogue", 60)

    live = d.status("ident-live")
    assert live.state is TransferState.BOOTSTRAPPING, live  # not failed as a "restart"
    assert refused.state is TransferState.FAILED, refused
    assert "PERMISSION_DENIED" in refused.detail, refused.detail
    assert real_prefill in refused.detail and caller in refused.detail, refused.detail

    with d.open_watch("ident-live", 60) as watch:
        p.send("ident-live", 2, SEQ, d.address)
        final = watch.wait()
    assert final.state is TransferState.SUCCESS, final
    d.release("ident-live")


def test_token_caller_claiming_another_prefills_address_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("identity-token\n")
    sec = Security(token="identity-token")
    auth = ["--auth-token-file", str(token)]
    dport = free_port()
    # Decode listens on both families, loopback only reaches it: the real prefill calls
    # it over 127.0.0.1 (an IPv4-mapped peer on the dual-stack socket), the rogue over
    # ::1, so the rogue calls from ::1 while it claims 127.0.0.1 (a token cannot vouch
    # for who you are, but the address you call from is seen).
    with _daemons(("decode", [*auth, "--advertise", f"127.0.0.1:{dport}"],
                   f"[::]:{dport}", sec),
                  ("prefill", auth, "127.0.0.1:0", sec)) as (decode, prefill), \
            KvbeamClient(prefill.address, security=sec) as p, \
            KvbeamClient(f"127.0.0.1:{dport}", security=sec) as d:
        with _daemons(("prefill", [*auth, "--advertise", prefill.address], "127.0.0.1:0",
                       sec)) as (rogue_daemon,), \
                KvbeamClient(rogue_daemon.address, security=sec) as rogue:
            _impersonation_is_refused(p, d, rogue, prefill.address, f"[::1]:{dport}", "::1")
        assert "claims control address" in decode.output


def test_mtls_certificate_not_naming_the_claimed_host_is_refused(pki: Pki) -> None:
    scheduler = pki.security("ident-scheduler")
    with _daemons(("decode", pki.flags("ident-decode"), "127.0.0.1:0", scheduler),
                  ("prefill", pki.flags("ident-prefill"), "127.0.0.1:0", scheduler)
                  ) as (decode, prefill), \
            KvbeamClient(prefill.address, security=scheduler) as p, \
            KvbeamClient(decode.address, security=scheduler) as d:
        # A valid certificate from the same CA, naming another host: it may serve and
        # call, but not claim to be the prefill at 127.0.0.1.
        rogue_flags = [*pki.flags("ident-rogue", sans="DNS:rogue.example,IP:10.9.9.9"),
                       "--advertise", prefill.address]
        to_rogue = dataclasses.replace(scheduler, tls_server_name="rogue.example")
        with _daemons(("prefill", rogue_flags, "127.0.0.1:0", to_rogue)) as (rogue_daemon,), \
                KvbeamClient(rogue_daemon.address, security=to_rogue) as rogue:
            _impersonation_is_refused(p, d, rogue, prefill.address, decode.address,
                                      "rogue.example")
        assert "claims control address" in decode.output
