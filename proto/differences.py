"""Difference <-> ``kvbeam.v1.Difference``: the structured list a refused handshake carries."""

from __future__ import annotations

from collections.abc import Iterable

from kvbeam.errors import Difference
from kvbeam.proto.fields import MAX_ITEMS, count, text
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb

MAX_MESSAGE_LEN = 1 << 16


def difference_to_proto(d: Difference) -> pb.Difference:
    """Encode one difference."""
    return pb.Difference(
        field=d.field, side=d.side, message=d.message,
        values=[pb.PartyValue(party=p, value=v) for p, v in d.values],
    )


def differences_to_proto(diffs: Iterable[Difference]) -> list[pb.Difference]:
    """Encode a list of differences, order kept."""
    return [difference_to_proto(d) for d in diffs]


def difference_from_proto(m: pb.Difference, field: str) -> Difference:
    """Decode one difference; raises ProtocolError for an empty or oversized field."""
    count(m.values, f"{field}.values", hi=16)
    return Difference(
        field=text(m.field, f"{field}.field"),
        side=text(m.side, f"{field}.side"),
        values=tuple(
            (text(v.party, f"{field}.values[{i}].party"),
             text(v.value, f"{field}.values[{i}].value", required=False, max_len=MAX_MESSAGE_LEN))
            for i, v in enumerate(m.values)
        ),
        message=text(m.message, f"{field}.message", max_len=MAX_MESSAGE_LEN),
    )


def differences_from_proto(items: Iterable[pb.Difference], field: str) -> list[Difference]:
    """Decode a repeated Difference field."""
    out = [difference_from_proto(m, f"{field}[{i}]") for i, m in enumerate(items)]
    count(out, field, hi=MAX_ITEMS)
    return out
