"""Transfer messages <-> Python values: states, failure reasons, statuses, index lists."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast

import numpy as np
import numpy.typing as npt

from kvbeam.errors import ProtocolError
from kvbeam.pools.types import INDEX_KINDS, IndexKind
from kvbeam.proto import engine_frames as ef
from kvbeam.proto.fields import MAX_ITEMS, enum_value
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.states import FailureReason, TransferFacts, TransferState, TransferStatus

STATE_TO_PROTO: dict[TransferState, pb.TransferState] = {
    s: cast(pb.TransferState, pb.TransferState.Value(f"TRANSFER_STATE_{s.name}"))
    for s in TransferState}
STATE_FROM_PROTO = {int(v): k for k, v in STATE_TO_PROTO.items()}
REASON_TO_PROTO: dict[FailureReason, pb.FailureReason] = {
    r: cast(pb.FailureReason, pb.FailureReason.Value(f"FAILURE_REASON_{r.name}"))
    for r in FailureReason}
REASON_FROM_PROTO = {int(v): k for k, v in REASON_TO_PROTO.items()}
KIND_TO_PROTO: dict[IndexKind, pb.IndexKind] = {
    k: cast(pb.IndexKind, pb.IndexKind.Value(f"INDEX_KIND_{k.name}"))
    for k in IndexKind}
KIND_FROM_PROTO = {int(v): k for k, v in KIND_TO_PROTO.items()}
#: Most indices accepted per list: a 1M-token request's ring rows or pages fit easily.
MAX_INDICES = 1 << 22


def status_to_proto(s: TransferStatus, *, slot: int = -1,
                    facts: TransferFacts | None = None,
                    timeline: Iterable[tuple[TransferState, float]] = ()) -> pb.TransferStatus:
    """A lifecycle snapshot as a ``TransferStatus`` reply, with what the request moves
    (``facts``) and when it entered each state (``timeline``)."""
    f = facts or TransferFacts()
    lists = []
    for name, length in f.lists:
        pool, _, kind = name.rpartition(".")
        lists.append(pb.ListLength(kind=KIND_TO_PROTO[IndexKind(kind)], pool=pool,
                                   length=length))
    return pb.TransferStatus(
        request_id=s.request_id, state=STATE_TO_PROTO[s.state],
        failure_reason=REASON_TO_PROTO[s.reason] if s.reason else None,
        detail=s.detail, slot=slot, peer=s.peer, age_s=s.age_s,
        bytes_total=f.bytes_total, bytes_done=f.bytes_done, lists=lists,
        kv_skip=f.kv_skip, verification=f.verification,
        timeline=[pb.StateEntered(state=STATE_TO_PROTO[state], after_s=after)
                  for state, after in timeline])


def facts_from_proto(m: pb.TransferStatus) -> TransferFacts:
    """The facts of a ``TransferStatus`` (its kinds and pools checked)."""
    lists = []
    for i, entry in enumerate(m.lists):
        kind = enum_value(entry.kind, KIND_FROM_PROTO, f"lists[{i}].kind", "IndexKind")
        if entry.pool not in ("", "draft"):
            raise ProtocolError(f"lists[{i}].pool", f"{entry.pool!r} is neither '' nor 'draft'")
        lists.append((f"{entry.pool}.{kind.value}" if entry.pool else kind.value,
                      entry.length))
    return TransferFacts(m.bytes_done, m.bytes_total, tuple(lists), m.kv_skip,
                         m.verification)


def timeline_from_proto(m: pb.TransferStatus) -> tuple[tuple[TransferState, float], ...]:
    """The states a ``TransferStatus`` says its transfer entered, and when."""
    return tuple((state_from_proto(e.state, f"timeline[{i}].state"), e.after_s)
                 for i, e in enumerate(m.timeline))


def state_from_proto(value: int, field: str = "state") -> TransferState:
    """Decode a TransferState (unset or unknown refused)."""
    return enum_value(value, STATE_FROM_PROTO, field, "TransferState")


def reason_from_proto(value: int, field: str = "failure_reason") -> FailureReason | None:
    """Decode a FailureReason; 0 (unset) is None."""
    return None if value == 0 else enum_value(value, REASON_FROM_PROTO, field, "FailureReason")


#: The pool names an IndexList may carry; "" is the target.
POOL_NAMES = ("", "target", "draft")


#: ``IndexList.packed``'s element: little-endian int64, whatever this machine's order.
_PACKED = np.dtype("<i8")
_NO_INDICES = np.zeros(0, dtype=np.int64)


def indices_to_proto(indices: Mapping[IndexKind, npt.NDArray[np.int64]],
                     draft: Mapping[IndexKind, npt.NDArray[np.int64]] | None = None, *,
                     packed: bool = False) -> list[pb.IndexList]:
    """Every kind's index list, in IndexKind order; then the draft's own lists (pool "draft").

    ``packed``: each list as ``IndexList.packed`` (little-endian int64s), what the
    daemons send each other; else as ``indices``, what clients get.
    """
    lists = [(k, indices[k], "") for k in INDEX_KINDS if k in indices]
    if draft:
        lists += [(k, draft[k], "draft") for k in INDEX_KINDS if k in draft]
    if packed:
        return [pb.IndexList(kind=KIND_TO_PROTO[k], pool=pool,
                             packed=(arr if arr.dtype == _PACKED else arr.astype(_PACKED))
                             .tobytes())
                for k, arr, pool in lists]
    return [pb.IndexList(kind=KIND_TO_PROTO[k], indices=arr.tolist(), pool=pool)
            for k, arr, pool in lists]


def _unpacked(item: pb.IndexList, where: str) -> npt.NDArray[np.int64]:
    """One list's indices, from ``packed`` or ``indices`` (not both), as int64s."""
    if not item.packed:
        if len(item.indices) > MAX_INDICES:
            raise ProtocolError(f"{where}.indices",
                                f"too many indices: {len(item.indices)} (at most {MAX_INDICES})")
        # fromiter with the length: about a third cheaper than asarray on upb's
        # repeated container (which numpy reads item by item through the sequence protocol).
        return np.fromiter(item.indices, np.int64, len(item.indices))
    if len(item.indices):
        raise ProtocolError(where, "sets both indices and packed (one or the other)")
    _packed_count(item.packed, where)
    # A copy in native order: frombuffer's view would be read-only and keep the message.
    return np.frombuffer(item.packed, _PACKED).astype(np.int64)


def index_lists_from_proto(lists: Iterable[pb.IndexList], field: str) -> tuple[
        dict[IndexKind, npt.NDArray[np.int64]], dict[IndexKind, npt.NDArray[np.int64]]]:
    """Decode index lists into (target, draft) by kind: each (pool, kind) at most once,
    each list from ``indices`` or ``packed``.

    Only the wire's own limits are checked here (known kind and pool, bounded
    length); ranges, lengths and duplicates are checked against a layout by
    :mod:`kvbeam.pools.engine_indices` or the planner.
    """
    target, draft, _ = _index_lists(lists, field)
    return target, draft


def _index_lists(lists: Iterable[pb.IndexList], field: str) -> tuple[
        dict[IndexKind, npt.NDArray[np.int64]], dict[IndexKind, npt.NDArray[np.int64]], bool]:
    """:func:`index_lists_from_proto`, and whether every index is known non-negative: the
    packed lists (what daemons send) are joined into one array by the compiled list
    codec (proto/_frames.c), which finds a negative index as it goes."""
    target: dict[IndexKind, npt.NDArray[np.int64]] = {}
    draft: dict[IndexKind, npt.NDArray[np.int64]] = {}
    helper = ef.list_codec()
    joined: list[tuple[dict[IndexKind, npt.NDArray[np.int64]], IndexKind, bytes]] = []
    for i, item in enumerate(lists):
        if i >= MAX_ITEMS:
            raise ProtocolError(field, f"too many index lists (at most {MAX_ITEMS})")
        kind = enum_value(item.kind, KIND_FROM_PROTO, f"{field}[{i}].kind", "IndexKind")
        if item.pool not in POOL_NAMES:
            raise ProtocolError(f"{field}[{i}].pool",
                                f"unknown pool {item.pool[:32]!r} (\"target\" or \"draft\")")
        out = draft if item.pool == "draft" else target
        if kind in out:
            raise ProtocolError(f"{field}[{i}].kind",
                                f"{kind.value} appears twice{' (draft)' if out is draft else ''}")
        if helper is not None and not len(item.indices):  # packed, or empty
            _packed_count(item.packed, f"{field}[{i}]")
            out[kind] = _NO_INDICES  # filled below, from the one joined array
            joined.append((out, kind, item.packed))
        else:
            out[kind] = _unpacked(item, f"{field}[{i}]")
    if not joined:
        return target, draft, False
    data, counts, negative = helper.unpack_int64([packed for _, _, packed in joined])
    every = np.frombuffer(data, dtype=np.int64)
    at = 0
    for (out, kind, _), n in zip(joined, counts, strict=True):
        out[kind] = every[at:at + n]  # views of one writable array, one list each
        at += n
    return target, draft, negative < 0 and len(joined) == len(target) + len(draft)


def _packed_count(packed: bytes, where: str) -> int:
    """How many int64s ``packed`` holds; ProtocolError when not whole ones or too many."""
    count, rest = divmod(len(packed), _PACKED.itemsize)
    if rest:
        raise ProtocolError(f"{where}.packed", f"{len(packed)} bytes is not a whole "
                            f"number of {_PACKED.itemsize}-byte indices")
    if count > MAX_INDICES:
        raise ProtocolError(f"{where}.packed",
                            f"too many indices: {count} (at most {MAX_INDICES})")
    return count


def grant_indices_from_proto(lists: Iterable[pb.IndexList], field: str) -> tuple[
        dict[IndexKind, npt.NDArray[np.int64]], dict[IndexKind, npt.NDArray[np.int64]]]:
    """Decode a daemon's answer's lists into (target, draft), each decoded once: every
    target kind exactly once, the draft's own lists (pool "draft") where given (empty:
    the draft uses the target's), no negative index in either.

    Range checks against a buffer happen in the planner, which knows the buffers.
    """
    target, draft, nonnegative = _index_lists(lists, field)
    for pool, out in (("", target), ("draft.", draft)):
        for kind, arr in out.items() if not nonnegative else ():
            if len(arr) and int(arr.min()) < 0:
                raise ProtocolError(f"{field}[{pool}{kind.value}].indices",
                                    f"negative index {int(arr.min())}")
    missing = [k.value for k in INDEX_KINDS if k not in target]
    if missing:
        raise ProtocolError(field, f"index kinds missing: {', '.join(missing)}")
    return target, draft
