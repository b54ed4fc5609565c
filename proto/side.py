"""One side's self-description, exchanged in the handshake: ``kvbeam.v1.SideInfo``.

:class:`SideInfo` is the Python value (role, layout, endpoint, identity); the
codec functions convert it to and from the message. Decoding checks the
protocol version first, because a peer of another version may give every other
field another meaning.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from kvbeam.errors import ProtocolError, ProtocolVersionError
from kvbeam.pools.layout import SideLayout
from kvbeam.proto.endpoint_codec import endpoint_from_proto, endpoint_to_proto
from kvbeam.proto.fields import enum_value, host_port, text
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.layout_codec import layout_from_proto, layout_to_proto
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.transport.endpoint import Endpoint

_INSTANCE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Role(enum.Enum):
    """A daemon's role in the prefill/decode pair."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def peer(self) -> Role:
        """The role a compatible peer has."""
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL


ROLE_TO_PROTO: dict[Role, pb.Role] = {
    Role.PREFILL: pb.Role.ROLE_PREFILL,
    Role.DECODE: pb.Role.ROLE_DECODE,
}
_ROLE_FROM_PROTO = {int(v): k for k, v in ROLE_TO_PROTO.items()}


def role_from_proto(value: int, field: str) -> Role:
    """Decode a ``kvbeam.v1.Role``; unset or unknown values raise ProtocolError."""
    return enum_value(value, _ROLE_FROM_PROTO, field, "Role")


def new_instance_id() -> str:
    """A fresh random instance id: a daemon takes one per process start."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class SideInfo:
    """What a side tells its peer: who it is, what its pools hold, where to write.

    Attributes:
        role: prefill or decode.
        layout: the side's pool layout (its metadata).
        endpoint: its data-plane endpoint for this peer link.
        instance_id: random per process start; a new one from the same
            ``control_address`` means the peer restarted.
        control_address: ``host:port`` of the side's own control server ("" if none).
        protocol_version: the kvbeam protocol version it speaks.
    """

    role: Role
    layout: SideLayout
    endpoint: Endpoint
    instance_id: str = field(default_factory=new_instance_id)
    control_address: str = ""
    protocol_version: int = PROTOCOL_VERSION


def check_protocol_version(value: int, field: str) -> int:
    """Refuse a missing or different protocol version (ProtocolVersionError for the latter)."""
    if value == 0:
        raise ProtocolError(field, "required field is missing (0)")
    if value != PROTOCOL_VERSION:
        raise ProtocolVersionError(PROTOCOL_VERSION, value, field=field)
    return value


def side_to_proto(side: SideInfo, *, validate: bool = True) -> pb.SideInfo:
    """Encode a side. With ``validate`` (default) the result is decoded back with the
    strict decoder, so a local value the peer would refuse fails here, locally."""
    msg = pb.SideInfo(
        protocol_version=side.protocol_version,
        role=ROLE_TO_PROTO[side.role],
        instance_id=side.instance_id,
        control_address=side.control_address,
        metadata=layout_to_proto(side.layout),
        endpoint=endpoint_to_proto(side.endpoint),
    )
    if validate:
        side_from_proto(msg)
    return msg


class SideEncoder:
    """Encodes one side again and again, cheaply: for the handshake hot path.

    The pool metadata (the bulk of the message, constant for a process) is
    built and strictly validated once; each :meth:`encode` validates only the
    endpoint, which may be new for every peer link.
    """

    def __init__(self, side: SideInfo) -> None:
        self.side = side
        self._template = side_to_proto(side, validate=True)

    def encode(self, endpoint: Endpoint | None = None) -> pb.SideInfo:
        """The side's message, with ``endpoint`` instead of ``side.endpoint`` when given."""
        msg = pb.SideInfo()
        msg.CopyFrom(self._template)
        if endpoint is not None and endpoint != self.side.endpoint:
            ep = endpoint_to_proto(endpoint)
            endpoint_from_proto(ep)
            msg.endpoint.CopyFrom(ep)
        return msg


def side_from_proto(m: pb.SideInfo, field: str = "side") -> SideInfo:
    """Decode and validate a peer's side.

    Raises:
        ProtocolVersionError: the peer speaks another protocol version.
        ProtocolError: any other malformed or inconsistent field (named).
    """
    version = check_protocol_version(m.protocol_version, f"{field}.protocol_version")
    role = role_from_proto(m.role, f"{field}.role")
    instance_id = text(m.instance_id, f"{field}.instance_id", max_len=128)
    if not _INSTANCE_ID.fullmatch(instance_id):
        raise ProtocolError(f"{field}.instance_id",
                            f"must be 1-128 characters of [A-Za-z0-9._:-] (got {instance_id!r})")
    if m.control_address:
        host_port(m.control_address, f"{field}.control_address")
    if not m.HasField("metadata"):
        raise ProtocolError(f"{field}.metadata", "required field is missing")
    layout = layout_from_proto(m.metadata, f"{field}.metadata")
    if not m.HasField("endpoint"):
        raise ProtocolError(f"{field}.endpoint", "required field is missing")
    endpoint = endpoint_from_proto(m.endpoint, f"{field}.endpoint")
    return SideInfo(role=role, layout=layout, endpoint=endpoint, instance_id=instance_id,
                    control_address=m.control_address, protocol_version=version)


def side_from_bytes(data: bytes, field: str = "side") -> SideInfo:
    """Parse and decode a serialized ``kvbeam.v1.SideInfo``; any failure is a ProtocolError."""
    msg = pb.SideInfo()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise ProtocolError(field, f"not a valid kvbeam.v1.SideInfo message: {exc}") from None
    return side_from_proto(msg, field)
