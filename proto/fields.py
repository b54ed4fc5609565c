"""Strict readers for decoded protobuf fields: every refusal names the field.

Protobuf happily parses a message with a negative size, an unknown enum number or
a missing sub-message; these helpers turn each such value into a
:class:`~kvbeam.errors.ProtocolError` naming the dotted field path, so a
decoder never lets a bad value through or fails with an unhandled exception.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sized
from typing import TypeVar

from kvbeam.errors import ProtocolError

T = TypeVar("T")

#: Longest accepted name (tensor, buffer, component, model, extra value...).
MAX_NAME_LEN = 256
#: Most entries accepted in one repeated field (tensors, buffers, regions...).
MAX_ITEMS = 1 << 16
#: Largest accepted byte size or offset (64 PiB): far above any pool, far below int64.
MAX_BYTES = 1 << 56


def int_in(value: int, field: str, lo: int, hi: int) -> int:
    """``value`` if ``lo <= value <= hi``, else a ProtocolError that says which bound failed."""
    if lo <= value <= hi:
        return value
    if value < lo and lo == 0:
        problem = "must not be negative"
    elif value < lo and lo == 1:
        problem = "must be positive"
    else:
        problem = f"out of range: must be in {lo}..{hi}"
    raise ProtocolError(field, f"{problem} (got {value})")


def text(value: str, field: str, *, required: bool = True, max_len: int = MAX_NAME_LEN) -> str:
    """A string field: non-empty when ``required``, at most ``max_len`` characters."""
    if required and not value:
        raise ProtocolError(field, "required field is missing (empty)")
    if len(value) > max_len:
        raise ProtocolError(field, f"too long: {len(value)} characters (at most {max_len})")
    return value


def count(items: Sized, field: str, *, lo: int = 0, hi: int = MAX_ITEMS) -> int:
    """The length of a repeated field, refused outside ``lo..hi`` entries."""
    n = len(items)
    if n < lo:
        raise ProtocolError(field, f"needs at least {lo} entr{'y' if lo == 1 else 'ies'} (got {n})")
    if n > hi:
        raise ProtocolError(field, f"too many entries: {n} (at most {hi})")
    return n


def enum_value(value: int, table: Mapping[int, T], field: str, enum_name: str) -> T:
    """Map a protobuf enum number through ``table``; unset (0) and unknown numbers are refused."""
    if value in table:
        return table[value]
    if value == 0:
        raise ProtocolError(field, f"required {enum_name} is unset")
    raise ProtocolError(field, f"unknown {enum_name} value {value}")


def host_port(value: str, field: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6]:port``; the port must be 1..65535."""
    text(value, field)
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ProtocolError(field, f"expected host:port (got {value!r})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ProtocolError(field, f"bad IPv6 address in {value!r}") from None
    elif ":" in host:
        raise ProtocolError(field, f"an IPv6 host needs brackets, e.g. [::1]:5000 (got {value!r})")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ProtocolError(field, f"port must be in 1..65535 (got {port})")
    return host, port


def big_endian_hint(length: int, limit: int) -> str:
    """What to add to the refusal of a 4-byte little-endian length over ``limit`` when
    its bytes read big-endian would fit: the engine channel and attach messages of a
    kvbeam before engine frames version 2 had big-endian lengths ("" otherwise)."""
    swapped = int.from_bytes(length.to_bytes(4, "little"), "big")
    if swapped > limit:
        return ""
    return (f" (read big-endian it is {swapped} bytes: the peer is a kvbeam whose engine "
            "framing is older than this daemon's; run the same kvbeam in the engine and "
            "the daemon)")
