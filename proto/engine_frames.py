"""The engine channel's frames: an engine's per-request calls and its daemon's pushed states.

After a successful attach (:mod:`kvbeam.proto.attach_codec`) the same Unix socket
carries compact binary frames both ways (docs/protocol.md, "The engine channel").
Every frame is a 4-byte length of what follows, then::

    u8 version (ENGINE_FRAMES_VERSION) | u8 kind | u16 id length | request id (UTF-8) | body

Engine to daemon: RESERVE (decode), SEND (prefill), ABORT, RELEASE (decode), DECLINE
(decode: a request it will not load, told to its prefill at once). Daemon to
engine: STATE (every state change of a request the engine started on this channel)
and ERROR (a frame refused: the field at fault and why). Several frames written at
once are a batch; nothing else marks one. A JSON attach-protocol message (its body
starts with ``{``) may still follow on the same socket: the detach.

Every integer is little-endian (the byte order of every kvbeam framing,
docs/protocol.md "Wire framings"). Strings are a u16 length and UTF-8; index lists are
``u8 count`` of ``u8 pool (0 target, 1 draft) | u8 kind (IndexKind order) | u32 n |
n u32``. Decoding is strict and every refusal is a :class:`FrameError`
naming the field. Pure data: no sockets, no gRPC, no torch.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbeam.compiled import helper_line, load_helper
from kvbeam.errors import FrameError
from kvbeam.pools.types import IndexKind
from kvbeam.proto.fields import big_endian_hint
from kvbeam.states import FailureReason, TransferState

__all__ = ["FrameError"]  # defined with every other error in kvbeam.errors

#: The frame format's version; a frame of another version is refused (ERROR "version").
ENGINE_FRAMES_VERSION = 4  # 4: a SEND piece may be ready in some layers (LAYERS)
#: Largest frame either side accepts (a 1M-token request's lists are ~100 KB); a
#: longer length is refused from the 4-byte prefix, before any of the body is read.
MAX_FRAME_BYTES = 16 << 20
#: Most index lists in one frame, most indices in one list.
MAX_LISTS = 64
MAX_INDICES = 1 << 22

RESERVE, SEND, ABORT, RELEASE, DECLINE = 1, 2, 3, 4, 5
STATE, ERROR = 16, 17
KIND_NAMES = {RESERVE: "RESERVE", SEND: "SEND", ABORT: "ABORT", RELEASE: "RELEASE",
              DECLINE: "DECLINE", STATE: "STATE", ERROR: "ERROR"}
ENGINE_KINDS = (RESERVE, SEND, ABORT, RELEASE, DECLINE)

#: SEND flags. EXTENDS: the frame's lists are the next piece of the request's source
#: lists (``u32 kv_offset`` follows the flags: where its KV pages start in the request's
#: KV_PAGES list), for an engine that learns its pages chunk by chunk (sglang). The
#: pages given so far are the pages the chunk makes ready. LAYERS (with EXTENDS, not
#: FINAL): ``u16 layers`` follows ``kv_offset``: the pages given so far are ready in the
#: model's layers ``[0, layers)`` only (an engine that sends each layer as it is
#: computed); without it a piece's pages are ready in every layer.
FINAL, HAS_LISTS, EXTENDS, LAYERS = 1, 2, 4, 8

#: STATE's state byte: sglang's KVPoll integers.
STATE_CODES = {TransferState.FAILED: 0, TransferState.BOOTSTRAPPING: 1,
               TransferState.WAITING_FOR_INPUT: 2, TransferState.TRANSFERRING: 3,
               TransferState.SUCCESS: 4}
STATE_FROM_CODE = {v: k for k, v in STATE_CODES.items()}
#: STATE's reason byte: 0 none, then FailureReason's order from 1.
REASON_CODES = {r: i + 1 for i, r in enumerate(FailureReason)}
REASON_FROM_CODE = {v: k for k, v in REASON_CODES.items()}
_KINDS = list(IndexKind)
_KIND_NUMBER = {k: i for i, k in enumerate(_KINDS)}


_HELPER, _HELPER_WHY = load_helper("kvbeam.proto._frames", "one call per frame's lists",
                                   "numpy")
#: Whether frames' index lists are packed and unpacked by the compiled codec; the numpy
#: path remains for where it was not built, for what it does not take (it answers None:
#: a value out of range, a malformed list section) and as its oracle.
COMPILED = _HELPER is not None


def list_codec() -> Any:
    """The compiled list codec when it is in use (:data:`COMPILED`), else None (the
    daemons' packed lists use it too: :mod:`kvbeam.proto.transfer_codec`)."""
    return _HELPER if COMPILED else None


def codec() -> str:
    """How this process codes frames' index lists: the compiled codec, or numpy and why."""
    return helper_line(_HELPER, _HELPER_WHY, COMPILED, "numpy")

_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<BBH")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_LIST = struct.Struct("<BBI")
_STATE = struct.Struct("<BBI")


Lists = dict[IndexKind, npt.NDArray[np.int64]]


@dataclass(frozen=True)
class Reserve:
    """Decode's reservation at the engine's destination lists.

    ``kv_skip``: leading KV pages of the request decode already holds (its prefix
    cache); the KV_PAGES list then names only the pages from that position on, and
    prefill writes only those. On the wire a trailing ``u32`` after the lists, present
    only when non-zero (a frame without it reserves the whole request).
    """

    request_id: str
    seq_len: int
    prefill_address: str
    indices: Lists = field(default_factory=dict)
    draft: Lists = field(default_factory=dict)
    kv_skip: int = 0


@dataclass(frozen=True)
class Send:
    """(A chunk of) a request prefill sends.

    Without ``kv_offset`` it is the whole request in one frame: final, with its lists.
    With it (flag EXTENDS) it is a chunk, and every frame of the request carries the
    next piece: its KV pages, which continue the request's KV_PAGES list at position
    ``kv_offset``, and, in the final frame, every other list whole. ``layers``
    (a piece that is not final): the pages given so far are ready in the model's
    layers ``[0, layers)`` only; None: in every layer.
    """

    request_id: str
    seq_len: int
    decode_address: str
    final: bool
    indices: Lists | None = None
    draft: Lists | None = None
    kv_offset: int | None = None
    layers: int | None = None


@dataclass(frozen=True)
class Abort:
    """Abort a request on this daemon (it tells the peer)."""

    request_id: str
    detail: str = ""


@dataclass(frozen=True)
class Release:
    """Decode's engine took the KV over: free the reservation."""

    request_id: str


@dataclass(frozen=True)
class Decline:
    """Decode will not load a request it reserved nothing for (e.g. it holds every
    block, or the request will not use prefill's KV): its daemon tells prefill at once,
    which fails its send and frees its source blocks instead of waiting out its lease."""

    request_id: str
    prefill_address: str
    detail: str = ""


@dataclass(frozen=True)
class State:
    """A request's new state, pushed by the daemon."""

    request_id: str
    state: TransferState
    reason: FailureReason | None
    version: int
    detail: str


@dataclass(frozen=True)
class Error:
    """The daemon refused a frame (``request_id`` empty when it could not be read)."""

    request_id: str
    field: str
    message: str


EngineFrame = Reserve | Send | Abort | Release | Decline
DaemonFrame = State | Error


# ---- encoding --------------------------------------------------------------------------
def _str(value: str, name: str) -> bytes:
    raw = value.encode()
    if len(raw) > 0xFFFF:
        raise FrameError(name, f"longer than {0xFFFF} bytes")
    return _U16.pack(len(raw)) + raw


def _frame(kind: int, request_id: str, body: bytes) -> bytes:
    rid = request_id.encode()
    if len(rid) > 0xFFFF:
        raise FrameError("request_id", f"longer than {0xFFFF} bytes")
    n = _HEAD.size + len(rid) + len(body)
    if n > MAX_FRAME_BYTES:
        raise FrameError("length", f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(n) + _HEAD.pack(ENGINE_FRAMES_VERSION, kind, len(rid)) + rid + body


def split_lists(mapping: Mapping[str, Sequence[int] | Any]) -> tuple[Lists, Lists]:
    """An engine's ``{"KIND" | "draft.KIND": indices}`` as (target, draft) by kind."""
    target: Lists = {}
    draft: Lists = {}
    for name, values in mapping.items():
        pool, _, kind = name.rpartition(".")
        if pool not in ("", "draft"):
            raise FrameError(f"indices[{name!r}]", "a name is KIND or draft.KIND")
        try:
            k = IndexKind(kind)
        except ValueError:
            raise FrameError(f"indices[{name!r}]", f"unknown index kind {kind!r} (known: "
                             f"{', '.join(x.value for x in IndexKind)})") from None
        (draft if pool else target)[k] = np.asarray(values, dtype=np.int64).reshape(-1)
    return target, draft


def _lists(target: Lists, draft: Lists) -> bytes:
    if COMPILED:
        packed = _HELPER.pack_lists(
            [(0, _KIND_NUMBER[k], v) for k, v in target.items()]
            + [(1, _KIND_NUMBER[k], v) for k, v in draft.items()])
        if packed is not None:  # None: the path below names what it does not take
            return packed  # type: ignore[no-any-return]
    parts = [_U8.pack(len(target) + len(draft))]
    for pool, lists in ((0, target), (1, draft)):
        for kind, values in lists.items():
            arr = np.asarray(values, dtype=np.int64).reshape(-1)
            if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
                raise FrameError(f"indices[{kind.value}]", "indices must be in 0..2^32-1")
            parts.append(_LIST.pack(pool, _KINDS.index(kind), len(arr)))
            parts.append(arr.astype("<u4").tobytes())
    return b"".join(parts)


def encode_state(request_id: str, state: TransferState, reason: FailureReason | None,
                 version: int, detail: str) -> bytes:
    """A :class:`State` frame from its fields, length prefix included: what the daemon
    pushes on every state change, so no frame object is built for it."""
    return _frame(STATE, request_id,
                  _STATE.pack(STATE_CODES[state], REASON_CODES[reason] if reason is not None
                              else 0, version & 0xFFFFFFFF) + _str(detail[:4096], "detail"))


def _check_whole(final: bool, has_lists: bool, extends: bool, layered: bool,
                 request_id: str) -> None:
    """A SEND without EXTENDS is a whole request: final, with its lists (one way to send
    in chunks: pieces); only a piece that is not final names its layers."""
    if not extends and not (final and has_lists):
        raise FrameError("kv_offset", "a SEND without kv_offset is the whole request in one "
                         "frame (final, with its lists); a chunk gives its piece of the "
                         "lists with kv_offset (flag EXTENDS)", request_id)
    if layered and (final or not extends):
        raise FrameError("layers", "only a piece that is not final (kv_offset, not final) "
                         "names the layers its pages are ready in: the final frame makes "
                         "every layer of every page ready", request_id)


def encode(frame: EngineFrame | DaemonFrame) -> bytes:
    """One frame, length prefix included."""
    if isinstance(frame, Reserve):
        if not 0 <= frame.kv_skip <= 0xFFFFFFFF:
            raise FrameError("kv_skip", f"must be in 0..2^32-1 (got {frame.kv_skip})")
        return _frame(RESERVE, frame.request_id,
                      _U32.pack(frame.seq_len) + _str(frame.prefill_address, "prefill_address")
                      + _lists(frame.indices, frame.draft)
                      + (_U32.pack(frame.kv_skip) if frame.kv_skip else b""))
    if isinstance(frame, Send):
        has = frame.indices is not None or frame.draft is not None
        layered = frame.layers is not None
        _check_whole(frame.final, has, frame.kv_offset is not None, layered,
                     frame.request_id)
        extends = frame.kv_offset is not None
        flags = (FINAL if frame.final else 0) | (HAS_LISTS if has else 0) | (
            EXTENDS if extends else 0) | (LAYERS if layered else 0)
        body = [_U32.pack(frame.seq_len), _str(frame.decode_address, "decode_address"),
                _U8.pack(flags)]
        if frame.kv_offset is not None:
            if not 0 <= frame.kv_offset <= 0xFFFFFFFF:
                raise FrameError("kv_offset", "must be in 0..2^32-1")
            body.append(_U32.pack(frame.kv_offset))
        if frame.layers is not None:
            if not 1 <= frame.layers <= 0xFFFF:
                raise FrameError("layers", "must be in 1..65535")
            body.append(_U16.pack(frame.layers))
        if has:
            body.append(_lists(frame.indices or {}, frame.draft or {}))
        return _frame(SEND, frame.request_id, b"".join(body))
    if isinstance(frame, Abort):
        return _frame(ABORT, frame.request_id, _str(frame.detail, "detail"))
    if isinstance(frame, Release):
        return _frame(RELEASE, frame.request_id, b"")
    if isinstance(frame, Decline):
        return _frame(DECLINE, frame.request_id,
                      _str(frame.prefill_address, "prefill_address") + _str(frame.detail,
                                                                            "detail"))
    if isinstance(frame, State):
        return encode_state(frame.request_id, frame.state, frame.reason, frame.version,
                            frame.detail)
    return _frame(ERROR, frame.request_id,
                  _str(frame.field[:256], "field") + _str(frame.message[:4096], "message"))


# ---- decoding (strict) -------------------------------------------------------------------
class _Cursor:
    def __init__(self, body: memoryview, request_id: str) -> None:
        self.body = body
        self.at = 0
        self.request_id = request_id

    def take(self, n: int, name: str) -> memoryview:
        if self.at + n > len(self.body):
            raise FrameError(name, f"frame ends early (needs {n} more bytes at offset "
                             f"{self.at}, has {len(self.body) - self.at})", self.request_id)
        out = self.body[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, st: struct.Struct, name: str) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size, name))

    def string(self, name: str) -> str:
        (n,) = self.unpack(_U16, name)
        try:
            return bytes(self.take(n, name)).decode()
        except UnicodeDecodeError:
            raise FrameError(name, "not UTF-8", self.request_id) from None

    def lists(self) -> tuple[Lists, Lists]:
        if COMPILED:
            got = _HELPER.unpack_lists(self.body, self.at, MAX_LISTS, MAX_INDICES, len(_KINDS))
            if got is not None:  # None: the path below names what is wrong
                meta, data, self.at = got
                every = np.frombuffer(data, dtype=np.int64)
                lists: tuple[Lists, Lists] = ({}, {})
                for pool, kind, start, n in meta:  # each a view of one array
                    lists[pool][_KINDS[kind]] = every[start:start + n]
                return lists
        (count,) = self.unpack(_U8, "lists")
        if count > MAX_LISTS:
            raise FrameError("lists", f"{count} lists (at most {MAX_LISTS})", self.request_id)
        target: Lists = {}
        draft: Lists = {}
        for i in range(count):
            pool, kind, n = self.unpack(_LIST, f"lists[{i}]")
            if pool not in (0, 1):
                raise FrameError(f"lists[{i}].pool", f"unknown pool {pool} (0 target, 1 draft)",
                                 self.request_id)
            if kind >= len(_KINDS):
                raise FrameError(f"lists[{i}].kind", f"unknown index kind {kind} (0..."
                                 f"{len(_KINDS) - 1})", self.request_id)
            if n > MAX_INDICES:
                raise FrameError(f"lists[{i}].count", f"{n} indices (at most {MAX_INDICES})",
                                 self.request_id)
            out = draft if pool else target
            if _KINDS[kind] in out:
                raise FrameError(f"lists[{i}].kind", f"{_KINDS[kind].value} appears twice"
                                 f"{' (draft)' if pool else ''}", self.request_id)
            raw = self.take(4 * n, f"lists[{i}].indices")
            out[_KINDS[kind]] = np.frombuffer(raw, dtype="<u4").astype(np.int64)
        return target, draft

    def end(self) -> None:
        if self.at != len(self.body):
            raise FrameError("length", f"{len(self.body) - self.at} bytes after the frame's "
                             "last field", self.request_id)


def decode(body: bytes | memoryview, allowed: Sequence[int] = ENGINE_KINDS
           ) -> EngineFrame | DaemonFrame:
    """Decode one frame's body (after the length prefix); only ``allowed`` kinds.

    Raises:
        FrameError: naming the field at fault (and the request id once it was read).
    """
    view = memoryview(body)
    if len(view) < _HEAD.size:
        raise FrameError("length", f"a frame is at least {_HEAD.size} bytes (got {len(view)})")
    version, kind, rid_len = _HEAD.unpack(view[:_HEAD.size])
    if version != ENGINE_FRAMES_VERSION:
        raise FrameError("version", f"engine frame version {version} is not supported "
                         f"(this side speaks {ENGINE_FRAMES_VERSION})")
    if kind not in allowed:
        raise FrameError("kind", f"frame kind {kind} is not one this side accepts "
                         f"({', '.join(f'{k} {KIND_NAMES[k]}' for k in allowed)})")
    cur = _Cursor(view[_HEAD.size:], "")
    try:
        rid = bytes(cur.take(rid_len, "request_id")).decode()
    except UnicodeDecodeError:
        raise FrameError("request_id", "not UTF-8") from None
    cur.request_id = rid
    out: EngineFrame | DaemonFrame
    if kind == RESERVE:
        (seq_len,) = cur.unpack(_U32, "seq_len")
        address = cur.string("prefill_address")
        target, draft = cur.lists()
        skip = cur.unpack(_U32, "kv_skip")[0] if len(cur.body) - cur.at == _U32.size else 0
        out = Reserve(rid, seq_len, address, target, draft, int(skip))
    elif kind == SEND:
        (seq_len,) = cur.unpack(_U32, "seq_len")
        address = cur.string("decode_address")
        (flags,) = cur.unpack(_U8, "flags")
        if flags & ~(FINAL | HAS_LISTS | EXTENDS | LAYERS):
            raise FrameError("flags", f"unknown flag bits {flags:#x}", rid)
        _check_whole(bool(flags & FINAL), bool(flags & HAS_LISTS), bool(flags & EXTENDS),
                     bool(flags & LAYERS), rid)
        offset = cur.unpack(_U32, "kv_offset")[0] if flags & EXTENDS else None
        layers = cur.unpack(_U16, "layers")[0] if flags & LAYERS else None
        if layers == 0:
            raise FrameError("layers", "must be at least 1 (a piece ready in no layer "
                             "makes nothing ready)", rid)
        lists = cur.lists() if flags & HAS_LISTS else None
        out = Send(rid, seq_len, address, bool(flags & FINAL),
                   lists[0] if lists else None, lists[1] if lists else None,
                   None if offset is None else int(offset),
                   None if layers is None else int(layers))
    elif kind == ABORT:
        out = Abort(rid, cur.string("detail"))
    elif kind == RELEASE:
        out = Release(rid)
    elif kind == DECLINE:
        out = Decline(rid, cur.string("prefill_address"), cur.string("detail"))
    elif kind == STATE:
        code, reason, version_ = cur.unpack(_STATE, "state")
        if code not in STATE_FROM_CODE:
            raise FrameError("state", f"unknown state {code}", rid)
        if reason and reason not in REASON_FROM_CODE:
            raise FrameError("reason", f"unknown failure reason {reason}", rid)
        out = State(rid, STATE_FROM_CODE[code], REASON_FROM_CODE.get(reason), version_,
                    cur.string("detail"))
    else:
        out = Error(rid, cur.string("field"), cur.string("message"))
    cur.end()
    return out


class FrameBuffer:
    """Splits a byte stream into frame bodies; a length over the limit is refused at once.

    :meth:`feed` the bytes as they arrive; it returns every complete body. A body
    starting with ``{`` is a JSON attach-protocol message (the detach), returned too.
    """

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The complete bodies in what arrived so far.

        Raises:
            FrameError: ``length``: a frame announces more than the limit (the stream
                cannot be resynchronised: close it).
        """
        buf = self._buf
        buf += data
        out: list[bytes] = []
        at = 0
        while len(buf) - at >= _LEN.size:
            (n,) = _LEN.unpack_from(buf, at)
            if n > self.limit:
                raise FrameError("length", f"frame of {n} bytes announced, the limit is "
                                 f"{self.limit}: refused before reading it"
                                 f"{big_endian_hint(n, self.limit)}")
            if len(buf) - at - _LEN.size < n:
                break
            out.append(bytes(buf[at + _LEN.size:at + _LEN.size + n]))
            at += _LEN.size + n
        if at:
            del buf[:at]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)
