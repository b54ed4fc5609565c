"""The scheduler's client: drive transfers through the daemons' gRPC API.

One :class:`KvbeamClient` per daemon address::

    decode = KvbeamClient("127.0.0.1:50052")
    prefill = KvbeamClient("127.0.0.1:50051")
    r = decode.reserve("req-1", seq_len=4096, prefill_address="127.0.0.1:50051")
    prefill.send("req-1", source_slot=3, seq_len=4096, decode_address="127.0.0.1:50052")
    status = decode.wait("req-1", timeout=30)      # Success or Failed(reason, detail)
    decode.release("req-1")                        # the engine took the KV over

An engine that chooses its own indices passes them per kind (docs/indices.md),
``{"KV_PAGES": [...], "SWA_RING_ROWS": [...], ..., "draft.SWA_RING_ROWS": [...]}``,
as ``indices=`` to :meth:`KvbeamClient.reserve` (decode's destination lists) and
:meth:`KvbeamClient.send` (prefill's source lists; ``source_slot`` is then ignored).

Every call has a deadline; errors are typed (:class:`Busy` for RESOURCE_EXHAUSTED,
:class:`~kvbeam.errors.UnknownRequest`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from kvbeam.auth import Security
from kvbeam.control_channel import ControlChannel
from kvbeam.errors import BadRequest, KvbeamError
from kvbeam.pools.engine_indices import ListLike, split_mapping
from kvbeam.pools.types import IndexKind
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.service import ControlStub
from kvbeam.proto.transfer_codec import (
    facts_from_proto,
    grant_indices_from_proto,
    indices_to_proto,
    reason_from_proto,
    state_from_proto,
    timeline_from_proto,
)
from kvbeam.rpc_errors import request_error
from kvbeam.states import FailureReason, TransferState

_RequestT = TypeVar("_RequestT")  # the request message of a call


@dataclass(frozen=True)
class Status:
    """A transfer's status as a daemon reports it."""

    request_id: str
    state: TransferState
    reason: FailureReason | None
    detail: str
    slot: int
    bytes_done: int
    bytes_total: int
    peer: str
    #: Each index list's length by kind ("draft.KIND": the draft's own), what moves of it.
    lists: tuple[tuple[str, int], ...] = ()
    #: Leading KV pages decode holds (not written).
    kv_skip: int = 0
    #: Whether and how the bytes are (or were) verified, in words.
    verification: str = ""
    #: Each state the transfer entered, seconds after its creation.
    timeline: tuple[tuple[TransferState, float], ...] = ()

    @property
    def terminal(self) -> bool:
        """Success or Failed."""
        return self.state.terminal

    def __str__(self) -> str:
        if self.state is TransferState.FAILED:
            reason = self.reason.value if self.reason else "?"
            return f"Failed({reason}, {self.detail})"
        return str(self.state.value)


@dataclass(frozen=True)
class Reservation:
    """Decode's answer to Reserve."""

    request_id: str
    slot: int
    indices: dict[IndexKind, npt.NDArray[np.int64]]
    lease_s: float
    decode_instance: str
    draft: dict[IndexKind, npt.NDArray[np.int64]] = field(default_factory=dict)


@dataclass(frozen=True)
class Capacity:
    """A daemon's load as its Heartbeat reports it (what a scheduler picks a daemon by)."""

    instance_id: str
    slots: int  # decode's request slots; 0 on prefill
    slots_held: int
    live_transfers: int

    @property
    def free(self) -> int:
        """Request slots free now (decode)."""
        return self.slots - self.slots_held


def _lists(indices: Mapping[str, ListLike] | None) -> list[pb.IndexList]:
    """An engine's ``{"KIND" | "draft.KIND": indices}`` as wire lists (none: slot-based)."""
    if not indices:
        return []
    target, draft = split_mapping(indices)
    return indices_to_proto(target, draft)


def _status(m: pb.TransferStatus) -> Status:
    facts = facts_from_proto(m)
    return Status(m.request_id, state_from_proto(m.state), reason_from_proto(m.failure_reason),
                  m.detail, m.slot, facts.bytes_done, facts.bytes_total, m.peer, facts.lists,
                  facts.kv_skip, facts.verification, timeline_from_proto(m))


class KvbeamClient(ControlChannel):
    """A channel to one kvbeam daemon (prefill or decode): the scheduler's calls.

    Args:
        address: the daemon's control address, ``host:port``.
        timeout: deadline of each call, seconds.
        security: credentials (mTLS and/or token) the daemon requires; default none.
    """

    def __init__(self, address: str, *, timeout: float = 5.0,
                 security: Security | None = None) -> None:
        super().__init__(address, timeout=timeout, security=security)

    def _error(self, exc: grpc.RpcError, method: str) -> KvbeamError:
        return request_error(exc, address=self.address, method=method, timeout=self.timeout)

    def _transfer_call(self, method: str,
                       rpc: grpc.UnaryUnaryMultiCallable[_RequestT, pb.TransferStatus],
                       request: _RequestT) -> Status:
        """One call answered by a TransferStatus, under the deadline; failures typed."""
        try:
            return _status(rpc(request, timeout=self.timeout))
        except grpc.RpcError as exc:
            raise self._error(exc, method) from None

    def reserve(self, request_id: str, seq_len: int, prefill_address: str, *,
                indices: Mapping[str, ListLike] | None = None, kv_skip: int = 0
                ) -> Reservation:
        """Decode: hold a slot for the request and learn (or give) its destination indices.

        ``indices``: the engine's destination lists keyed by kind name, ``"draft.KIND"``
        for the draft's own lists (docs/indices.md); the reservation's slot is then -1.
        A bad list raises :class:`~kvbeam.errors.BadRequest` naming the kind and index.
        ``kv_skip``: leading KV pages decode already holds; ``KV_PAGES`` then names only
        the pages from there on, and prefill writes only those (docs/protocol.md,
        "Partial loads").
        """
        lists = _lists(indices)
        if not 0 <= kv_skip <= 0xFFFFFFFF:
            raise BadRequest(f"kv_skip {kv_skip}: a count of leading KV pages (0..2^32-1)")
        try:
            r = self.stub.Reserve(pb.ReserveRequest(request_id=request_id, seq_len=seq_len,
                                                    prefill_address=prefill_address,
                                                    indices=lists, kv_skip=kv_skip),
                                  timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, "Reserve") from None
        if lists and r.slot != -1:  # a daemon without engine lists ignores the field
            raise BadRequest(f"Reserve on {self.address}: the decode daemon ignored the index "
                             "lists (it predates engine-chosen indices) and reserved slot "
                             f"{r.slot}; abort {request_id} and upgrade it")
        target, draft = grant_indices_from_proto(r.indices, "indices")
        return Reservation(r.request_id, r.slot, target, r.lease_ms / 1000, r.instance_id,
                           draft)

    def send(self, request_id: str, source_slot: int, seq_len: int, decode_address: str, *,
             final: bool = True, chunks: Sequence[tuple[int, int]] = (),
             indices: Mapping[str, ListLike] | None = None) -> Status:
        """Prefill: queue (a chunk of) the request for decode; returns at once.

        ``indices``: the engine's source lists of the whole request, keyed like
        :meth:`reserve`'s (``source_slot`` is then ignored); a further chunk may omit them.
        ``chunks``: the token ranges computed so far (a chunk that is not ``final`` must
        name them): prefill writes the whole KV pages up to the furthest end not written
        yet; a page a chunk fills in part goes with a later chunk, once it is whole.
        """
        lists = _lists(indices)
        # With lists the slot is -1 on the wire: a daemon that predates them refuses it.
        req = pb.SendRequest(request_id=request_id, source_slot=-1 if lists else source_slot,
                             seq_len=seq_len, decode_address=decode_address, final_chunk=final,
                             chunks=[pb.TokenRange(start=a, end=b) for a, b in chunks],
                             indices=lists)
        return self._transfer_call("Send", self.stub.Send, req)

    def status(self, request_id: str) -> Status:
        """The transfer's current status on this daemon."""
        return self._transfer_call("Status", self.stub.Status,
                                   pb.StatusRequest(request_id=request_id))

    def watch(self, request_id: str, timeout: float) -> Iterator[Status]:
        """Each state change until the transfer ends or ``timeout`` seconds pass."""
        with self.open_watch(request_id, timeout) as w:
            yield from w.changes()

    def open_watch(self, request_id: str, timeout: float) -> StatusWatch:
        """Open WatchStatus now and read it later (:meth:`StatusWatch.wait`): the stream is
        set up while the caller does something else, e.g. Send on prefill, so a request's
        Send-to-Success does not wait for a second call's setup after Send returned.
        Close it (a ``with`` block) when not read to the end."""
        return StatusWatch(self.stub, request_id, timeout, error=self._error, status=self.status)

    def wait(self, request_id: str, timeout: float) -> Status:
        """The terminal status, or the last one seen when ``timeout`` passes."""
        with self.open_watch(request_id, timeout) as w:
            return w.wait()

    def abort(self, request_id: str, detail: str = "") -> Status:
        """Abort on this daemon; it propagates to the peer."""
        return self._transfer_call("Abort", self.stub.Abort,
                                   pb.AbortRequest(request_id=request_id, detail=detail))

    def release(self, request_id: str) -> Status:
        """Decode: the engine took the request over; free its slot."""
        return self._transfer_call("Release", self.stub.Release,
                                   pb.ReleaseRequest(request_id=request_id))

    def capacity(self) -> Capacity:
        """The daemon's instance id and load, from one Heartbeat round trip."""
        try:
            r = self.stub.Heartbeat(pb.HeartbeatRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, "Heartbeat") from None
        return Capacity(r.instance_id, r.slots, r.slots_held, r.live_transfers)


class StatusWatch:
    """One request's WatchStatus stream, opened at construction (the call starts at once)
    and read with :meth:`wait` or :meth:`changes`; see :meth:`KvbeamClient.open_watch`.

    WatchStatus sends the current status first, so no Status RPC is needed before it.
    A stream that ends before the request is terminal (the daemon restarted the watch,
    or the call's deadline passed early) is opened again until ``timeout``.
    """

    def __init__(self, stub: ControlStub, request_id: str, timeout: float, *,
                 error: Callable[[grpc.RpcError, str], KvbeamError],
                 status: Callable[[str], Status]) -> None:
        self._stub = stub
        self._error = error
        self._status = status
        self._request_id = request_id
        self._end = time.monotonic() + timeout
        self._call = self._open()

    def _open(self) -> grpc.CallIterator[pb.TransferStatus]:
        return self._stub.WatchStatus(
            pb.StatusRequest(request_id=self._request_id),
            timeout=max(0.1, self._end - time.monotonic()))

    def changes(self) -> Iterator[Status]:
        """Each state change on the current stream, until it ends (terminal or timeout):
        DEADLINE_EXCEEDED ends it quietly, other errors are typed."""
        try:
            for m in self._call:
                yield _status(m)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise self._error(exc, "WatchStatus") from None

    def wait(self) -> Status:
        """The terminal status, or the last one seen when the timeout passes."""
        last: Status | None = None
        while True:
            for s in self.changes():
                last = s
                if s.terminal:
                    return s
            if time.monotonic() >= self._end:
                break
            self._call = self._open()
        return last if last is not None else self._status(self._request_id)

    def close(self) -> None:
        """Cancel the stream (harmless when it already ended)."""
        self._call.cancel()  # type: ignore[no-untyped-call]

    def __enter__(self) -> StatusWatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
