"""Fuzzing the strict decoders: random bytes and valid-but-wrong messages never crash.

Every outcome is either a decoded value or a typed ProtocolError; anything else
(an IndexError, a ValueError from protobuf, a RecursionError...) fails the test.
"""

from __future__ import annotations

import contextlib
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbeam.errors import ProtocolError
from kvbeam.pools.checks import compare_sides
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.rejection_codec import decode_rejection
from kvbeam.proto.side import Role, SideInfo, side_from_bytes, side_from_proto, side_to_proto
from tests.control_helpers import config, rdma_endpoint, side

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

_VALID_SIDE = side(Role.DECODE, config(), rdma_endpoint(), control_address="127.0.0.1:7000")
_VALID = side_to_proto(_VALID_SIDE).SerializeToString()
_VALID_LAYOUT = _VALID_SIDE.layout

# Integers that hit every boundary the decoder checks.
INTS = st.one_of(
    st.sampled_from([0, 1, -1, 2, 4, 128, 255, 256, 1024, 4096, (1 << 24) - 1, 1 << 24,
                     (1 << 31), (1 << 56), (1 << 56) + 1, (1 << 63) - 1, -(1 << 63)]),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
)
TEXT = st.one_of(st.sampled_from(["", "x", "a b", "::1", "h:0", "h:65535", "[::1]:5",
                                  "fe80::1", "z" * 300]), st.text(max_size=40))


def _decode(data: bytes) -> SideInfo | None:
    try:
        return side_from_bytes(data)
    except ProtocolError:
        return None


def _check_round_trip(decoded: SideInfo | None) -> None:
    # Whatever the decoder accepts, we can send back and decode identically, and
    # the handshake's comparison runs on it without crashing.
    if decoded is not None:
        event("decoded")
        assert side_from_proto(side_to_proto(decoded)) == decoded
        compare_sides(decoded.layout, _VALID_LAYOUT)
        compare_sides(_VALID_LAYOUT, decoded.layout)
    else:
        event("refused")


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _check_round_trip(_decode(data))


@FUZZ
@given(st.data())
def test_corrupted_valid_message(data: st.DataObject) -> None:
    buf = bytearray(_VALID)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    _check_round_trip(_decode(bytes(buf[:cut]) if data.draw(st.booleans()) else bytes(buf)))


def _scalar_fields(msg: Message, path: str = "") -> list[tuple[Message, Any, str]]:
    """Every scalar field of a message tree (repeated fields by their container)."""
    out: list[tuple[Message, Any, str]] = []
    for fd in msg.DESCRIPTOR.fields:
        name = f"{path}.{fd.name}" if path else fd.name
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if fd.is_repeated:
                if fd.message_type is None or fd.message_type.GetOptions().map_entry:
                    continue
                for i, item in enumerate(getattr(msg, fd.name)):
                    out.extend(_scalar_fields(item, f"{name}[{i}]"))
            elif msg.HasField(fd.name):
                out.extend(_scalar_fields(getattr(msg, fd.name), name))
        else:
            out.append((msg, fd, name))
    return out


def _assign(msg: Message, fd: FieldDescriptor, value: Any) -> None:
    try:
        if fd.is_repeated:
            container = getattr(msg, fd.name)
            if isinstance(value, list):
                del container[:]
                container.extend(value)
            else:
                container.append(value)
        else:
            setattr(msg, fd.name, value)
    except (ValueError, TypeError):
        pass  # protobuf itself refuses the value (e.g. a negative uint32): nothing to decode


def _value_for(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if fd.type == FieldDescriptor.TYPE_STRING:
        return TEXT
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 200)
    if fd.is_repeated:
        return st.one_of(INTS, st.lists(INTS, max_size=4))
    return INTS


@FUZZ
@given(st.data())
def test_valid_but_wrong_messages(data: st.DataObject) -> None:
    msg = pb.SideInfo.FromString(_VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["set", "set", "set", "clear", "dup", "drop"]))
        fields = _scalar_fields(msg)
        if action == "set":
            target, fd, _ = data.draw(st.sampled_from(fields))
            _assign(target, fd, data.draw(_value_for(fd)))
        elif action == "clear":
            sub = data.draw(st.sampled_from(["metadata", "endpoint", "metadata.target",
                                             "metadata.draft"]))
            owner: Message = msg.metadata if sub.startswith("metadata.") else msg
            owner.ClearField(sub.rpartition(".")[2])
        elif action == "dup" and msg.metadata.components:
            comp = data.draw(st.sampled_from(list(msg.metadata.components)))
            msg.metadata.components.add().CopyFrom(comp)
        elif action == "drop" and msg.metadata.components:
            del msg.metadata.components[data.draw(st.integers(0, len(msg.metadata.components) - 1))]
    try:
        decoded = side_from_proto(msg)
    except ProtocolError:
        return
    _check_round_trip(decoded)


@FUZZ
@given(st.binary(max_size=256))
def test_rejection_trailer_bytes(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_rejection(data)
