"""Endpoint <-> ``kvbeam.v1.Endpoint``: a side's data-plane address for one peer link.

RDMA endpoints must carry what an RC queue pair needs to reach RTR (GID, QPNs,
PSN, MTU); TCP endpoints a ``host:port``. Fields a transport does not need are
empty on the wire and ignored. Regions are checked one by one (a region must not
wrap past 2**64); how they map onto the pool's buffers is the transport's business.
"""

from __future__ import annotations

import ipaddress
import re

from kvbeam.errors import ProtocolError
from kvbeam.proto.fields import MAX_ITEMS, MAX_NAME_LEN, count, enum_value, host_port, int_in, text
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.transport.endpoint import Endpoint, RemoteRegion

KIND_TO_PROTO: dict[str, pb.TransportKind] = {
    "rdma": pb.TransportKind.TRANSPORT_KIND_RDMA,
    "tcp": pb.TransportKind.TRANSPORT_KIND_TCP,
}
_KIND_FROM_PROTO = {int(v): k for k, v in KIND_TO_PROTO.items()}

#: IB path MTUs (bytes) a verbs QP accepts.
RDMA_MTUS = (256, 512, 1024, 2048, 4096)
#: QPNs and PSNs are 24-bit on the wire (IBTA).
MAX_24BIT = (1 << 24) - 1
MAX_U64 = (1 << 64) - 1
MAX_EXTRA = 64
MAX_EXTRA_VALUE_LEN = 1024
_HEX_GID = re.compile(r"[0-9a-fA-F]{32}")


def endpoint_to_proto(endpoint: Endpoint) -> pb.Endpoint:
    """Encode an endpoint. Raises ProtocolError for an unknown kind or an unencodable value."""
    kind = KIND_TO_PROTO.get(endpoint.kind)
    if kind is None:
        raise ProtocolError("endpoint.kind",
                            f"unknown transport kind {endpoint.kind!r} (expected rdma or tcp)")
    try:
        return pb.Endpoint(
            kind=kind,
            gid=endpoint.gid,
            qpns=list(endpoint.qpns),
            psn=endpoint.psn,
            mtu=endpoint.mtu,
            address=endpoint.address,
            regions=[pb.RemoteRegion(addr=r.addr, length=r.length, rkey=r.rkey)
                     for r in endpoint.regions],
            extra=dict(endpoint.extra),
        )
    except (ValueError, TypeError) as exc:
        raise ProtocolError("endpoint", f"cannot encode the endpoint: {exc}") from exc


def _gid(value: str, field: str) -> str:
    text(value, field, max_len=64)
    if _HEX_GID.fullmatch(value):
        return value
    try:
        ipaddress.IPv6Address(value)
    except ValueError:
        raise ProtocolError(field, f"not a GID (IPv6 text or 32 hex digits): {value!r}") from None
    return value


def endpoint_from_proto(m: pb.Endpoint, field: str = "endpoint") -> Endpoint:
    """Decode and validate an endpoint.

    Raises:
        ProtocolError: naming the first offending field.
    """
    kind = enum_value(m.kind, _KIND_FROM_PROTO, f"{field}.kind", "TransportKind")
    count(m.regions, f"{field}.regions", hi=MAX_ITEMS)
    regions = []
    for i, r in enumerate(m.regions):
        where = f"{field}.regions[{i}]"
        int_in(r.length, f"{where}.length", 1, MAX_U64)
        if r.addr + r.length > MAX_U64 + 1:
            raise ProtocolError(where, f"region [{r.addr:#x}, +{r.length}) wraps past 2**64")
        regions.append(RemoteRegion(addr=int(r.addr), length=int(r.length), rkey=int(r.rkey)))
    count(m.extra, f"{field}.extra", hi=MAX_EXTRA)
    extra: dict[str, str] = {}
    for key in sorted(m.extra):
        text(key, f"{field}.extra key", max_len=MAX_NAME_LEN)
        extra[key] = text(m.extra[key], f"{field}.extra[{key!r}]", required=False,
                          max_len=MAX_EXTRA_VALUE_LEN)
    if kind == "rdma":
        gid = _gid(m.gid, f"{field}.gid")
        count(m.qpns, f"{field}.qpns", lo=1, hi=MAX_ITEMS)
        for i, qpn in enumerate(m.qpns):
            int_in(qpn, f"{field}.qpns[{i}]", 1, MAX_24BIT)
        int_in(m.psn, f"{field}.psn", 0, MAX_24BIT)
        if m.mtu not in RDMA_MTUS:
            raise ProtocolError(f"{field}.mtu",
                                f"must be one of {', '.join(map(str, RDMA_MTUS))} (got {m.mtu})")
        return Endpoint(kind=kind, regions=tuple(regions), gid=gid,
                        qpns=tuple(int(q) for q in m.qpns), psn=int(m.psn), mtu=int(m.mtu),
                        address=text(m.address, f"{field}.address", required=False),
                        extra=extra)
    host_port(m.address, f"{field}.address")
    return Endpoint(kind=kind, regions=tuple(regions), address=m.address, extra=extra)
