"""A peer's claimed control address, bound to what authenticated the caller.

Prefill dials decode for the handshake and names, in its SideInfo, the control address
decode calls back (Offers, Aborts, heartbeats). Decode recognises the prefill by that
address: a reservation names it, and a handshake claiming the same address with a new
instance id is a restart that fails the old instance's requests. An authenticated
caller could otherwise claim any address and so fail, or take over, another prefill's
requests. :func:`claim_refusal` says when a caller may not claim an address:

- **mTLS** (without ``--tls-server-name``): the caller's client certificate must name
  the claimed host in its subjectAltName (a DNS name, ``*.`` wildcards for one label,
  or an IP address). A daemon's certificate names its advertised host already: peers
  dial it there and verify that name.
- **Shared token**, or mTLS with ``--tls-server-name`` (certificates then name one
  shared name, not addresses): the claimed host must be (or resolve to) the address
  the call comes from. A token proves membership, not which member; the source
  address is the one thing the server sees for itself.
- **No authentication**: nothing is checked; any caller may claim anything (loopback
  development, or ``--insecure``).

An empty claim (a peer running no control server) is always allowed: it names no one.

The same rule decides whether an Abort that says it is prefill's (``from_peer``) comes
from the request's prefill (:meth:`kvbeam.server.core.decode.DecodeCore.abort`): the
caller must be allowed to claim that prefill's address, since the instance id it names
is no secret.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Iterable, Mapping

from kvbeam.auth import Security
from kvbeam.errors import ProtocolError
from kvbeam.proto.fields import host_port

#: ``grpc.ServicerContext.auth_context()`` keys of the client certificate's SANs.
SAN_DNS_KEY = "peer_dns"
SAN_IP_KEY = "peer_ip"


def caller_ip(peer: str) -> str | None:
    """The IP address in gRPC's ``context.peer()`` (``ipv4:10.0.0.1:5000``,
    ``ipv6:[::1]:5000``, IPv4-mapped IPv6 as IPv4); None for anything else."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def host_addresses(host: str) -> set[str]:
    """The IP addresses ``host`` names: itself when it is one, else what it resolves to
    (empty when it does not resolve)."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    out = set()
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).partition("%")[0])
        out.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return out


def san_covers(host: str, dns_names: Iterable[str], ips: Iterable[str]) -> bool:
    """Whether a certificate naming ``dns_names`` and ``ips`` covers ``host``.

    An IP literal must be one of the IP SANs; a name must equal a DNS SAN
    (case-insensitive) or match a ``*.domain`` SAN in its leftmost label only.
    """
    try:
        want = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        for ip in ips:
            try:
                if ipaddress.ip_address(ip) == want:
                    return True
            except ValueError:
                continue
        return False
    name = host.rstrip(".").lower()
    for san in dns_names:
        pattern = san.rstrip(".").lower()
        if pattern == name:
            return True
        if pattern.startswith("*.") and "." in name:
            first, rest = name.split(".", 1)
            if first and rest == pattern[2:]:
                return True
    return False


#: ``auth_context()``: grpc gives a list of values per key (its stubs say one value).
AuthContext = Mapping[str, Iterable[bytes] | bytes]


def _strings(auth: AuthContext, key: str) -> list[str]:
    values = auth.get(key, ())
    if isinstance(values, bytes):
        values = [values]
    return [v.decode("utf-8", "replace") for v in values]


def claim_refusal(claimed: str, *, security: Security, peer: str,
                  auth: AuthContext, call: str = "handshake") -> str | None:
    """Why the caller may not claim ``claimed`` as its control address; None if it may.

    May resolve ``claimed``'s host (a token's rule): never call it under a lock.

    Args:
        claimed: the control address in the caller's SideInfo ("" : none claimed), or
            the address of the peer a call claims to come from (decode's Abort that
            says it is prefill's, checked against the request's prefill).
        security: how this server authenticates its callers.
        peer: ``context.peer()`` of the call.
        auth: ``context.auth_context()`` of the call (the client certificate's SANs).
        call: what the caller sent, for the message ("handshake", "Abort").
    """
    if not claimed or not security.authenticated:
        return None
    try:
        host = host_port(claimed, "side.control_address")[0]
    except ProtocolError as exc:
        return f"{call} from {peer} refused: {exc}"
    ip = caller_ip(peer)
    caller = ip or peer
    if security.tls and not security.tls_server_name:
        dns, ips = _strings(auth, SAN_DNS_KEY), _strings(auth, SAN_IP_KEY)
        if san_covers(host, dns, ips):
            return None
        names = ", ".join([*dns, *ips]) or "nothing"
        return (f"{call} from {caller} refused: it claims control address {claimed}, but "
                f"its client certificate names {names} (subjectAltName), not {host}; a peer "
                "may only claim an address its certificate names")
    if ip is not None and ip in host_addresses(host):
        return None
    how = "mTLS with --tls-server-name" if security.tls else "a shared token"
    return (f"{call} from {caller} refused: it claims control address {claimed}, but "
            f"calls from {caller}, which {host} does not name; under {how} a peer may only "
            "claim an address at the host it calls from (set its --advertise to the address "
            "it dials its peers from)")
