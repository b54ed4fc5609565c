"""The peer channel's frames: the one daemon-to-daemon protocol after the handshake.

One TCP connection per daemon pair carries every per-request message between the two
daemons (docs/protocol.md, "The peer channel"): decode's offers and its answers to
BeginWrite, prefill's BeginWrite and answers to offers, both sides' aborts and
heartbeats. Every integer is little-endian. Every frame is::

    u8 kind | u32 correlation id | u32 payload length | payload

A request's payload (:data:`REQUESTS`) is ``u32 timeout_ms`` then its protobuf message
(``BeginWriteRequest``, ``AbortRequest``); its REPLY carries the same correlation id and
``u8 status code (gRPC's numbering) | u32 writes in flight | u32 details length |
details (UTF-8) | the response message``. A one-way frame's (:data:`ONE_WAY`: decode's
``OfferRequest``, prefill's ``OfferResponse`` when it has something to say) payload is
the message alone, correlation id 0, no reply. HELLO is ``u32 protocol version`` then
three ``u16 length | UTF-8`` strings (prefill's instance, decode's instance, the pair's
token). Decoding is strict: a malformed frame is a :class:`FrameError` naming the field.
Pure data: no sockets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import grpc

from kvbeam.errors import FrameError, PeerChannelError

HEADER = struct.Struct("<BII")  # kind, correlation id, payload length
_HELLO_HEAD = struct.Struct("<I")  # protocol version; then three u16-prefixed strings
_U16 = struct.Struct("<H")
_TIMEOUT = struct.Struct("<I")  # a request's deadline, ms
_REPLY_HEAD = struct.Struct("<BII")  # status code, writes in flight, details length

HELLO = 1  # prefill -> decode: the channel's first frame (version, instance ids, token)
WELCOME = 2  # decode -> prefill: the HELLO was accepted; the channel is bound
PING = 3
PONG = 4
BYE = 5  # either way: an orderly close (payload: why); the peer's link, not the peer, went
OFFER = 16  # decode -> prefill, one-way: an OfferRequest
BEGIN_WRITE = 17  # prefill -> decode, a request: a BeginWriteRequest
ABORT = 19  # either way, a request: an AbortRequest (18 is never used again)
OFFER_ANSWER = 20  # prefill -> decode, one-way: an OfferResponse, only when not the usual
REPLY = 32  # the answer to a request, same correlation id

KIND_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", PING: "PING", PONG: "PONG", BYE: "BYE",
              OFFER: "Offer", BEGIN_WRITE: "BeginWrite", ABORT: "Abort",
              OFFER_ANSWER: "OfferAnswer", REPLY: "REPLY"}
#: The requests and one-way frames each side may receive, by its role.
REQUESTS_TO = {"prefill": frozenset({OFFER, ABORT}),
               "decode": frozenset({BEGIN_WRITE, ABORT, OFFER_ANSWER})}
#: Frames that expect no REPLY (correlation id 0; the payload is the message alone):
#: prefill keeps an offer without a word (the usual case) and says only what decode
#: must act on (OFFER_ANSWER).
ONE_WAY = frozenset({OFFER, OFFER_ANSWER})

#: Largest payload accepted: a 1M-token request's index lists are ~100 KB; the length
#: is refused from the header, before any of the payload is read.
MAX_PAYLOAD = 16 << 20
#: Longest a token or an instance id in a HELLO may be.
MAX_HELLO_STRING = 256
#: Longest a HELLO's payload may be.
MAX_HELLO_BYTES = _HELLO_HEAD.size + 3 * (MAX_HELLO_STRING + _U16.size)
#: Most bytes of a BYE's reason and of a REPLY's details that are sent.
MAX_REASON_BYTES = 4096
MAX_DETAILS_BYTES = 1 << 16

#: gRPC status codes by number (a REPLY and an OFFER_ANSWER carry the number).
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class Reply:
    """An OK answer: the response message's bytes and the writes still in flight."""

    payload: bytes
    in_flight: int = 0


@dataclass(frozen=True)
class Hello:
    """The first frame of a channel: who opens it, to whom, with which token."""

    version: int
    prefill_instance: str
    decode_instance: str
    token: str


def kind_name(kind: int) -> str:
    """A frame kind's name for messages (its number when unknown)."""
    return KIND_NAMES.get(kind, f"kind {kind}")


def frame(kind: int, correlation: int, payload: bytes = b"") -> bytes:
    """One frame's bytes.

    Raises:
        FrameError: the payload is over :data:`MAX_PAYLOAD`.
    """
    if len(payload) > MAX_PAYLOAD:
        raise FrameError("payload", f"{len(payload)} bytes, over the limit of {MAX_PAYLOAD}")
    return HEADER.pack(kind, correlation, len(payload)) + payload


def notice(kind: int, message: bytes) -> bytes:
    """A one-way frame (:data:`ONE_WAY`): correlation 0, the message as its payload."""
    return frame(kind, 0, message)


def bye(reason: str) -> bytes:
    """A BYE frame saying why."""
    return frame(BYE, 0, reason.encode()[:MAX_REASON_BYTES])


def split_frames(inbox: bytearray) -> list[tuple[int, int, bytes]]:
    """Take every whole frame off the front of ``inbox``: (kind, correlation, payload).

    Raises:
        FrameError: a header announcing more than :data:`MAX_PAYLOAD`.
    """
    out = []
    at = 0
    while len(inbox) - at >= HEADER.size:
        kind, correlation, length = HEADER.unpack_from(inbox, at)
        if length > MAX_PAYLOAD:
            raise FrameError(kind_name(kind),
                             f"payload of {length} bytes, over the limit of {MAX_PAYLOAD}")
        end = at + HEADER.size + length
        if end > len(inbox):
            break
        out.append((kind, correlation, bytes(inbox[at + HEADER.size:end])))
        at = end
    del inbox[:at]
    return out


def _string(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > MAX_HELLO_STRING:
        raise FrameError("hello", f"a string of {len(raw)} bytes (at most {MAX_HELLO_STRING})")
    return _U16.pack(len(raw)) + raw


def encode_hello(hello: Hello) -> bytes:
    """The HELLO frame."""
    return frame(HELLO, 0, _HELLO_HEAD.pack(hello.version) + _string(hello.prefill_instance)
                 + _string(hello.decode_instance) + _string(hello.token))


def decode_hello(payload: bytes) -> Hello:
    """A HELLO's payload, strictly; FrameError names what is wrong."""
    if len(payload) < _HELLO_HEAD.size:
        raise FrameError("hello", f"{len(payload)} bytes, too short for its version")
    (version,) = _HELLO_HEAD.unpack_from(payload)
    at = _HELLO_HEAD.size
    out: list[str] = []
    for name in ("prefill_instance", "decode_instance", "token"):
        if at + _U16.size > len(payload):
            raise FrameError(f"hello.{name}", "missing")
        (n,) = _U16.unpack_from(payload, at)
        at += _U16.size
        if n > MAX_HELLO_STRING or at + n > len(payload):
            raise FrameError(f"hello.{name}", f"length {n} runs past the frame or the limit")
        try:
            out.append(payload[at:at + n].decode())
        except UnicodeDecodeError:
            raise FrameError(f"hello.{name}", "not UTF-8") from None
        at += n
    if at != len(payload):
        raise FrameError("hello", f"{len(payload) - at} trailing byte(s)")
    return Hello(version, out[0], out[1], out[2])


def encode_request(kind: int, correlation: int, message: bytes, timeout_s: float) -> bytes:
    """A request frame: its deadline, then its protobuf message."""
    ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    return frame(kind, correlation, _TIMEOUT.pack(ms) + message)


def decode_request(payload: bytes) -> tuple[float, bytes]:
    """(timeout s, message bytes) of a request's payload."""
    if len(payload) < _TIMEOUT.size:
        raise FrameError("request", f"{len(payload)} bytes, too short for its deadline")
    (ms,) = _TIMEOUT.unpack_from(payload)
    return ms / 1000, payload[_TIMEOUT.size:]


def encode_reply(correlation: int, code: grpc.StatusCode, details: str = "",
                 message: bytes = b"", in_flight: int = 0) -> bytes:
    """A REPLY frame."""
    raw = details.encode()[:MAX_DETAILS_BYTES]
    return frame(REPLY, correlation, _REPLY_HEAD.pack(code.value[0], max(0, in_flight),
                                                      len(raw)) + raw + message)


def decode_reply(payload: bytes) -> Reply | PeerChannelError:
    """A REPLY's payload: the answer, or the peer's refusal as a PeerChannelError."""
    if len(payload) < _REPLY_HEAD.size:
        raise FrameError("reply", f"{len(payload)} bytes, too short for its status")
    value, in_flight, n = _REPLY_HEAD.unpack_from(payload)
    code = STATUS_CODES.get(value)
    if code is None:
        raise FrameError("reply.status", f"unknown status code {value}")
    start = _REPLY_HEAD.size
    if start + n > len(payload):
        raise FrameError("reply.details", f"length {n} runs past the frame")
    details = payload[start:start + n].decode("utf-8", "replace")
    if code is not grpc.StatusCode.OK:
        return PeerChannelError(code, details, in_flight)
    return Reply(payload[start + n:], in_flight)
