"""The structured reason of a refused handshake, carried in gRPC trailing metadata.

A gRPC call that ends with a non-OK status delivers no reply message, so the
server attaches a serialized ``kvbeam.v1.HandshakeRejection`` as the binary
trailer :data:`REJECTION_KEY` (gRPC's "rich error details" pattern without the
googleapis dependency). It carries every difference and the server's own
metadata, so the client can run the same verification itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from kvbeam.errors import Difference, ProtocolError
from kvbeam.pools.layout import SideLayout
from kvbeam.proto.differences import differences_from_proto, differences_to_proto
from kvbeam.proto.fields import text
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.layout_codec import layout_from_proto, layout_to_proto
from kvbeam.proto.side import ROLE_TO_PROTO, Role, SideInfo, role_from_proto

#: Trailing-metadata key of the serialized HandshakeRejection ("-bin": binary value).
REJECTION_KEY = "kvbeam-rejection-bin"
#: Request-metadata key by which a client announces how large a rejection it reads.
BUDGET_KEY = "kvbeam-max-rejection-bytes"
#: Trailer budget for a client that announces nothing (grpcurl, another language):
#: gRPC's default header limits are 8 KiB soft / 16 KiB hard, a "-bin" value
#: grows by 4/3 in base64, and a trailer over the limit would replace our
#: FAILED_PRECONDITION with RESOURCE_EXHAUSTED. So: differences only, truncated.
DEFAULT_REJECTION_BYTES = 4 << 10
#: The most a client may ask for (our client asks for this; see ControlOptions).
MAX_REJECTION_BYTES = 1 << 20
#: Longest status details string (it travels percent-encoded in a header).
MAX_DETAILS_CHARS = 1000

Reason = pb.RejectReason


@dataclass(frozen=True)
class Rejection:
    """A decoded HandshakeRejection.

    ``layout`` is the server's metadata when it sent it and it decoded cleanly;
    ``role``/``instance_id`` identify the server.
    """

    reason: pb.RejectReason
    message: str
    differences: list[Difference] = field(default_factory=list)
    field: str = ""
    protocol_version: int = 0
    role: Role | None = None
    instance_id: str = ""
    layout: SideLayout | None = None


def encode_rejection(reason: pb.RejectReason, message: str, *, local: SideInfo,
                     differences: Sequence[Difference] = (), field: str = "",
                     include_metadata: bool = True,
                     budget: int = DEFAULT_REJECTION_BYTES) -> bytes:
    """Serialize a rejection from our side ``local`` in at most ``budget`` bytes.

    What does not fit is dropped in this order: our metadata (the client then
    relies on our difference list), the tail of the difference list, the tail of
    the message. ``message`` should state the full difference count.
    """
    msg = pb.HandshakeRejection(
        reason=reason, message=message[:MAX_REJECTION_BYTES // 4],
        differences=differences_to_proto(differences), field=field,
        protocol_version=local.protocol_version, role=ROLE_TO_PROTO[local.role],
        instance_id=local.instance_id,
    )
    if include_metadata:
        msg.metadata.CopyFrom(layout_to_proto(local.layout))
    if msg.ByteSize() > budget:
        msg.ClearField("metadata")
    while len(msg.differences) > 1 and msg.ByteSize() > budget:
        del msg.differences[max(1, len(msg.differences) // 2):]
    if msg.ByteSize() > budget:
        msg.message = msg.message[:MAX_DETAILS_CHARS]
    return msg.SerializeToString()


def requested_budget(invocation_metadata: Iterable[Any] | None) -> int:
    """The rejection budget a client announced (:data:`BUDGET_KEY`), clamped to our range."""
    for key, value in invocation_metadata or ():
        if key == BUDGET_KEY and isinstance(value, str) and value.isascii() and value.isdigit():
            return max(DEFAULT_REJECTION_BYTES, min(int(value), MAX_REJECTION_BYTES))
    return DEFAULT_REJECTION_BYTES


def find_rejection(trailing_metadata: Iterable[Any] | None) -> bytes | None:
    """The raw rejection trailer of a failed call, or None.

    Accepts what ``RpcError.trailing_metadata()`` returns: (key, value) pairs.
    """
    for key, value in trailing_metadata or ():
        if key == REJECTION_KEY and isinstance(value, bytes):
            return value
    return None


def decode_rejection(data: bytes) -> Rejection:
    """Parse a rejection trailer strictly.

    A server metadata block that fails to decode is dropped (``layout`` None), not
    fatal: the server's own difference list still stands.

    Raises:
        ProtocolError: the trailer is not a valid HandshakeRejection.
    """
    msg = pb.HandshakeRejection()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise ProtocolError(REJECTION_KEY, f"not a valid kvbeam.v1.HandshakeRejection: {exc}")\
            from None
    layout = None
    if msg.HasField("metadata"):
        try:
            layout = layout_from_proto(msg.metadata, "rejection.metadata")
        except ProtocolError:
            layout = None
    role = role_from_proto(msg.role, "rejection.role") if msg.role else None
    return Rejection(
        reason=msg.reason,
        message=text(msg.message, "rejection.message", required=False, max_len=1 << 20),
        differences=differences_from_proto(msg.differences, "rejection.differences"),
        field=text(msg.field, "rejection.field", required=False),
        protocol_version=int(msg.protocol_version),
        role=role,
        instance_id=text(msg.instance_id, "rejection.instance_id", required=False),
        layout=layout,
    )


def status_details(message: str) -> str:
    """The gRPC status details for a rejection: the message, shortened to fit a header."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return message[:MAX_DETAILS_CHARS - 40] + f" ... ({len(message)} characters in all)"
