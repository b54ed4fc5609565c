"""The engine attach wire: length-prefixed JSON over a local Unix socket, fds by SCM_RIGHTS.

An engine hands its pools to its local daemon (:mod:`kvbeam.engine.attach` sends,
:mod:`kvbeam.server.engines.attach` receives). Each message is a 4-byte little-endian length
followed by that many bytes of UTF-8 JSON; the attach request's file descriptors
travel as SCM_RIGHTS ancillary data with its first bytes. docs/engine.md documents
the protocol. Request::

    {"version": 1, "op": "attach", "memory_kind": "host_shm",
     "config": {"model": ..., "target": {...}, "draft": {...} | null},
     "components": [[{"fd_index": 0, "offset": 0, "length": n, "item_len": k}, ...], ...],
     "pushes": "all" | "final"}

``components`` is positional, as :attr:`kvbeam.pools.layout.SideLayout.components`
(main KV first, the target states, the draft last); ``fd_index`` indexes the fds
sent with the message. ``pushes`` (optional, default ``all``) says which of its
requests' state changes the engine channel pushes: every one, or only Success and
Failed (:data:`PUSH_MODES`). ``{"version": 1, "op": "detach"}`` ends an attachment (so
does closing the socket). Reply: ``{"ok": bool, "error": str, "field": str,
"instance_id": str, "channel": int}`` (``channel``: the engine-channel frame version
spoken on the socket after the attach, :mod:`kvbeam.proto.engine_frames`).
Pure data: no torch, no gRPC.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import reprlib
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbeam.errors import AttachError
from kvbeam.pools.spec import PoolSpec, SideConfig
from kvbeam.proto.fields import big_endian_hint

#: The attach protocol's version; a daemon refuses any other.
ATTACH_VERSION = 2
OPS = ("attach", "detach")
#: ``host_shm``: memfd/tmpfs host memory; ``dmabuf``: device memory as dma-buf fds
#: (kvbeam.server.engines.dmabuf says what a daemon takes).
MEMORY_KINDS = ("host_shm", "dmabuf")
#: Which state changes the engine channel pushes to the engine: ``all`` (every change,
#: the default) or ``final`` (Success and Failed only: an engine that acts only on a
#: request's end is not woken for the states between, docs/engine.md).
PUSH_MODES = ("all", "final")
#: Largest message either side reads (a 61-layer DSV4 description is ~30 KB).
MAX_MESSAGE_BYTES = 4 << 20
#: Most fds one attach may carry.
MAX_FDS = 253  # SCM_MAX_FD
#: Most characters of a reply's ``error`` (a refusal may quote what it refuses: the rest is
#: cut, and the text says so) and of its ``field``: every answer stays a few KiB.
MAX_ERROR_CHARS = 2000
MAX_FIELD_CHARS = 200
_LEN = struct.Struct("<I")
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother = 2, 40, 40
_SHOW.maxlist = _SHOW.maxdict = _SHOW.maxtuple = 4


@dataclass(frozen=True)
class BufferRef:
    """Where one buffer lives: ``length`` bytes at ``offset`` in fd ``fd_index``."""

    fd_index: int
    offset: int
    length: int
    item_len: int


@dataclass(frozen=True)
class AttachRequest:
    """A decoded request (``config`` and ``components`` empty for detach)."""

    op: str
    memory_kind: str = "host_shm"
    config: SideConfig | None = None
    components: tuple[tuple[BufferRef, ...], ...] = ()
    version: int = ATTACH_VERSION
    #: Which state changes the engine channel pushes (:data:`PUSH_MODES`).
    pushes: str = "all"


@dataclass(frozen=True)
class AttachReply:
    """The daemon's answer; ``field`` names the part of the request at fault."""

    ok: bool
    error: str = ""
    field: str = ""
    instance_id: str = ""
    #: The engine-channel frame version the daemon speaks after this attach
    #: (:mod:`kvbeam.proto.engine_frames`); 0: none (an older daemon).
    channel: int = 0


# ---- config <-> mapping ----------------------------------------------------------
def spec_to_mapping(spec: PoolSpec) -> dict[str, Any]:
    """A pool spec as its side-YAML mapping (every field, lists for tuples)."""
    out = dataclasses.asdict(spec)
    out["compression_ratios"] = list(spec.compression_ratios)
    out["aux_item_lens"] = list(spec.aux_item_lens)
    return out


def config_to_mapping(config: SideConfig) -> dict[str, Any]:
    """A side config as the mapping a side YAML parses to."""
    return {"model": config.model, "target": spec_to_mapping(config.target),
            "draft": None if config.draft is None else spec_to_mapping(config.draft)}


def config_differences(mine: SideConfig, theirs: SideConfig) -> list[str]:
    """``field: daemon=X, engine=Y`` for every field that differs (empty: the same)."""
    a, b = config_to_mapping(mine), config_to_mapping(theirs)
    out = []
    if a["model"] != b["model"]:
        out.append(f"model: daemon={a['model']!r}, engine={b['model']!r}")
    for pool in ("target", "draft"):
        pa, pb = a[pool], b[pool]
        if (pa is None) != (pb is None):
            out.append(f"{pool}: daemon={'absent' if pa is None else 'present'}, "
                       f"engine={'absent' if pb is None else 'present'}")
        if pa is None or pb is None:
            continue
        out += [f"{pool}.{key}: daemon={pa[key]!r}, engine={pb[key]!r}"
                for key in pa if pa[key] != pb[key]]
    return out


def first_config_difference(mine: SideConfig, theirs: SideConfig) -> str | None:
    """The first of :func:`config_differences`, or None."""
    diffs = config_differences(mine, theirs)
    return diffs[0] if diffs else None


# ---- bounded text ------------------------------------------------------------------
def shown(value: object) -> str:
    """A value from the wire as a refusal quotes it: its repr, depth and length bounded
    (never a multi-MB message, never a recursion through deeply nested input)."""
    return _SHOW.repr(value)


def bounded(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` characters; a cut text says how much went."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


# ---- encoding --------------------------------------------------------------------
def frame(payload: Mapping[str, Any]) -> bytes:
    """One message: the length prefix and the JSON body."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise AttachError(f"attach message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _LEN.pack(len(body)) + body


def request_to_json(req: AttachRequest) -> dict[str, Any]:
    """The JSON object of a request."""
    out: dict[str, Any] = {"version": req.version, "op": req.op}
    if req.op == "attach":
        if req.config is None:
            raise AttachError("an attach request needs the side config", "config")
        out["memory_kind"] = req.memory_kind
        out["config"] = config_to_mapping(req.config)
        out["components"] = [[dataclasses.asdict(b) for b in comp] for comp in req.components]
        out["pushes"] = req.pushes
    return out


def reply_to_json(reply: AttachReply) -> dict[str, Any]:
    """The JSON object of a reply; its error and field bounded (:data:`MAX_ERROR_CHARS`)."""
    out = dataclasses.asdict(reply)
    out["error"] = bounded(reply.error, MAX_ERROR_CHARS)
    out["field"] = bounded(reply.field, MAX_FIELD_CHARS)
    return out


def decode_body(body: bytes) -> object:
    """A message body's JSON value.

    Raises:
        AttachError: not UTF-8 JSON, or nested too deeply for the decoder.
    """
    try:
        return json.loads(body)
    except RecursionError:
        raise AttachError("attach message is not JSON this daemon reads: nested too "
                          "deeply") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise AttachError(f"attach message is not JSON: {bounded(str(exc), 200)}") from None


# ---- decoding (strict: every refusal names its field) ----------------------------
def _int(value: object, field: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AttachError(f"{field}: must be an integer >= {minimum} (got {shown(value)})",
                          field)
    return value


def push_mode(value: object) -> str:
    """``value`` when it is one of :data:`PUSH_MODES`; else AttachError naming ``pushes``
    (the engine checks before it connects, the daemon what arrives)."""
    if value not in PUSH_MODES:
        raise AttachError(f"pushes: unknown push mode {shown(value)} (known: "
                          f"{', '.join(PUSH_MODES)})", "pushes")
    return str(value)


def request_from_json(data: object, nfds: int) -> AttachRequest:
    """Decode and check a request's structure; ``nfds`` fds came with it.

    Raises:
        AttachError: an unknown version, op or memory kind, a malformed config or
            buffer; the message names the field.
    """
    if not isinstance(data, dict):
        raise AttachError(f"attach message must be a JSON object (got {type(data).__name__})")
    version = data.get("version")
    if version != ATTACH_VERSION:
        raise AttachError(f"version: attach protocol version {shown(version)} is not supported "
                          f"(this daemon speaks {ATTACH_VERSION})", "version")
    op = data.get("op")
    if op not in OPS:
        raise AttachError(f"op: unknown op {shown(op)} (known: {', '.join(OPS)})", "op")
    if op == "detach":
        return AttachRequest(op="detach")
    kind = data.get("memory_kind")
    if kind not in MEMORY_KINDS:
        raise AttachError(f"memory_kind: unknown memory kind {shown(kind)} (known: "
                          f"{', '.join(MEMORY_KINDS)})", "memory_kind")
    pushes = push_mode(data.get("pushes", "all"))
    raw = data.get("config")
    if not isinstance(raw, dict):
        raise AttachError(f"config: must be an object (the side YAML's mapping), got "
                          f"{shown(raw)}", "config")
    try:
        config = SideConfig.from_mapping(raw, source="engine config")
    except RecursionError:
        raise AttachError("config: nested too deeply", "config") from None
    except Exception as exc:  # ConfigError names the field; anything else is malformed
        raise AttachError(f"config: {bounded(str(exc), 500)}", "config") from None
    comps = data.get("components")
    if not isinstance(comps, list):
        raise AttachError("components: must be a list of buffer lists", "components")
    out: list[tuple[BufferRef, ...]] = []
    for i, comp in enumerate(comps):
        if not isinstance(comp, list):
            raise AttachError(f"components[{i}]: must be a list of buffers", f"components[{i}]")
        bufs = []
        for j, b in enumerate(comp):
            where = f"components[{i}][{j}]"
            if not isinstance(b, dict):
                raise AttachError(f"{where}: must be an object", where)
            ref = BufferRef(_int(b.get("fd_index"), f"{where}.fd_index"),
                            _int(b.get("offset"), f"{where}.offset"),
                            _int(b.get("length"), f"{where}.length", 1),
                            _int(b.get("item_len"), f"{where}.item_len", 1))
            if ref.fd_index >= nfds:
                raise AttachError(f"{where}.fd_index: {ref.fd_index} but only {nfds} fd(s) "
                                  "came with the message", f"{where}.fd_index")
            bufs.append(ref)
        out.append(tuple(bufs))
    return AttachRequest(op="attach", memory_kind=kind, config=config, components=tuple(out),
                         pushes=pushes)


def reply_from_json(data: object) -> AttachReply:
    """Decode a reply."""
    if not isinstance(data, dict) or not isinstance(data.get("ok"), bool):
        raise AttachError(f"malformed attach reply: {shown(data)}")
    return AttachReply(ok=data["ok"], error=str(data.get("error", "")),
                       field=str(data.get("field", "")),
                       instance_id=str(data.get("instance_id", "")),
                       channel=data["channel"] if isinstance(data.get("channel"), int) else 0)


# ---- socket I/O ----------------------------------------------------------------------
class MessageReader:
    """One message arriving in pieces on a non-blocking socket (the daemon's attach loop
    reads a connecting engine's message this way, between its other work).

    :meth:`wanted` says how many bytes to ask for next, never past the message's end
    (what follows it stays in the socket); :meth:`feed` takes what arrived and returns
    the body once it is whole.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._size: int | None = None

    @property
    def progress(self) -> str:
        """How much arrived, for messages (``N of M bytes``)."""
        if self._size is None:
            return f"{len(self._buf)} of the {_LEN.size} length bytes"
        return f"{len(self._buf)} of {self._size} bytes"

    def wanted(self, chunk: int) -> int:
        """Bytes to read next: the rest of the length prefix, else up to ``chunk`` of the
        body."""
        if self._size is None:
            return _LEN.size - len(self._buf)
        return min(chunk, self._size - len(self._buf))

    def feed(self, data: bytes) -> bytes | None:
        """Take what arrived; the whole body once it is complete, else None.

        Raises:
            AttachError: the length prefix announces more than :data:`MAX_MESSAGE_BYTES`
                (refused before any of the body is read).
        """
        self._buf += data
        if self._size is None:
            if len(self._buf) < _LEN.size:
                return None
            (n,) = _LEN.unpack(self._buf[:_LEN.size])
            if n > MAX_MESSAGE_BYTES:
                raise AttachError(f"attach message of {n} bytes exceeds {MAX_MESSAGE_BYTES}"
                                  f"{big_endian_hint(n, MAX_MESSAGE_BYTES)}")
            self._size, self._buf = n, self._buf[_LEN.size:]
        return bytes(self._buf) if len(self._buf) >= self._size else None


def _recv_exact(sock: socket.socket, n: int, head: bytes = b"",
                deadline: float | None = None) -> bytes:
    buf = bytearray(head)
    while len(buf) < n:
        if deadline is not None:
            _time_left(sock, deadline, f"{len(buf)} of {n} bytes")
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _time_left(sock: socket.socket, deadline: float, progress: str) -> None:
    """Bound the next read by what is left until ``deadline`` (monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"the message did not arrive whole in time ({progress} read)")
    sock.settimeout(left)


def read_message(sock: socket.socket, *, with_fds: bool = False,
                 deadline: float | None = None) -> tuple[object, list[int]]:
    """Read one message (and the fds sent with its first bytes); raises EOFError at EOF.

    With ``deadline`` (``time.monotonic()``) the whole message must arrive by then, however
    the sender paces it (TimeoutError otherwise); without it, the socket's timeout bounds
    each read. Fds received are returned even when the body is refused later: the caller
    closes them.
    """
    fds: list[int] = []
    if deadline is not None:
        _time_left(sock, deadline, "nothing")
    if with_fds:
        head, fds, flags, _ = socket.recv_fds(sock, _LEN.size, MAX_FDS)
        if not head:
            raise EOFError("connection closed")
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                _close_quietly(fd)
            raise AttachError(f"fds: more than {MAX_FDS} file descriptors sent (truncated)",
                              "fds")
    else:
        head = sock.recv(_LEN.size)
        if not head:
            raise EOFError("connection closed")
    try:
        (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, head, deadline))
        if n > MAX_MESSAGE_BYTES:
            raise AttachError(f"attach message of {n} bytes exceeds {MAX_MESSAGE_BYTES}"
                              f"{big_endian_hint(n, MAX_MESSAGE_BYTES)}")
        return decode_body(_recv_exact(sock, n, deadline=deadline)), fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
