"""The rules binding a caller's claimed control address to its credentials
(server/peers/identity.py)."""

from __future__ import annotations

import pytest

from kvbeam.auth import Security
from kvbeam.server.peers.identity import caller_ip, claim_refusal, san_covers

TOKEN = Security(token="t")
#: mTLS as far as the rules go (the files are never read here).
MTLS = Security(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem")
MTLS_NAMED = Security(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem",
                      tls_server_name="kvbeam")


def _sans(dns: list[str], ips: list[str]) -> dict[str, list[bytes]]:
    return {"peer_dns": [d.encode() for d in dns], "peer_ip": [i.encode() for i in ips]}


@pytest.mark.parametrize(("peer", "ip"), [
    ("ipv4:10.0.0.5:40000", "10.0.0.5"),
    ("ipv6:[::1]:40000", "::1"),
    ("ipv6:%5B::1%5D:40000", "::1"),
    ("ipv6:[::ffff:127.0.0.1]:40000", "127.0.0.1"),
    ("unix:/run/x.sock", None),
    ("ipv4:not-an-ip:1", None),
])
def test_caller_ip_from_grpc_peer(peer: str, ip: str | None) -> None:
    assert caller_ip(peer) == ip


@pytest.mark.parametrize(("host", "dns", "ips", "covered"), [
    ("prefill-0.kv.svc", ["prefill-0.kv.svc"], [], True),
    ("PREFILL-0.kv.svc", ["prefill-0.kv.svc"], [], True),
    ("prefill-0.kv.svc", ["*.kv.svc"], [], True),
    ("a.prefill-0.kv.svc", ["*.kv.svc"], [], False),  # a wildcard covers one label
    ("kv.svc", ["*.kv.svc"], [], False),
    ("prefill-1.kv.svc", ["prefill-0.kv.svc"], [], False),
    ("10.0.0.5", [], ["10.0.0.5"], True),
    ("10.0.0.5", ["10.0.0.5"], [], False),  # an IP host needs an IP SAN
    ("::1", [], ["0:0:0:0:0:0:0:1"], True),
    ("10.0.0.6", [], ["10.0.0.5"], False),
])
def test_san_covers(host: str, dns: list[str], ips: list[str], covered: bool) -> None:
    assert san_covers(host, dns, ips) is covered


def test_mtls_claim_must_be_named_by_the_certificate() -> None:
    assert claim_refusal("127.0.0.1:7000", security=MTLS, peer="ipv4:127.0.0.1:1",
                         auth=_sans(["localhost"], ["127.0.0.1"])) is None
    why = claim_refusal("127.0.0.1:7000", security=MTLS, peer="ipv4:127.0.0.1:1",
                        auth=_sans(["rogue.example"], ["10.9.9.9"]))
    assert why is not None
    assert "claims control address 127.0.0.1:7000" in why
    assert "rogue.example, 10.9.9.9" in why and "not 127.0.0.1" in why
    # The caller's address does not stand in for the certificate.
    assert claim_refusal("127.0.0.1:7000", security=MTLS, peer="ipv4:127.0.0.1:1",
                         auth={}) is not None


@pytest.mark.parametrize("security", [TOKEN, MTLS_NAMED], ids=["token", "mtls-server-name"])
def test_token_claim_must_be_where_the_call_comes_from(security: Security) -> None:
    assert claim_refusal("10.0.0.5:7000", security=security, peer="ipv4:10.0.0.5:4444",
                         auth={}) is None
    assert claim_refusal("localhost:7000", security=security, peer="ipv4:127.0.0.1:4444",
                         auth={}) is None  # a name that resolves to the caller
    why = claim_refusal("10.0.0.5:7000", security=security, peer="ipv4:10.0.0.9:4444",
                        auth={})
    assert why is not None
    assert "claims control address 10.0.0.5:7000" in why and "calls from 10.0.0.9" in why
    assert claim_refusal("no-such-host.invalid:7000", security=security,
                         peer="ipv4:10.0.0.9:1", auth={}) is not None


def test_unauthenticated_servers_and_empty_claims_check_nothing() -> None:
    assert claim_refusal("10.0.0.5:7000", security=Security(), peer="ipv4:10.0.0.9:1",
                         auth={}) is None
    assert claim_refusal("", security=TOKEN, peer="ipv4:10.0.0.9:1", auth={}) is None
