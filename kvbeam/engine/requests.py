"""Per-request calls an engine scheduler makes, shaped like sglang's KV sender/receiver.

Prefill, once a request's KV is in its pools (``attachment``: the engine's
:class:`~kvbeam.engine.attach.Attachment` to its daemon)::

    s = Sender(attachment, "req-1", decode_address="127.0.0.1:50052")
    s.send(kv_pages, {"SWA_RING_ROWS": rows, "REQ_SLOT": [item]}, seq_len=4096)
    while s.poll() not in (KVPoll.Success, KVPoll.Failed): ...
    s.failure_exception()          # raises TransferFailed when it failed

Decode, before prefill sends::

    r = Receiver(attachment, "req-1", prefill_address="127.0.0.1:50051")
    r.send_metadata(kv_pages, {"SWA_RING_ROWS": rows, "REQ_SLOT": [item]}, seq_len=4096)
    ... r.poll() == KVPoll.Success ...; r.release()   # the engine took the KV over

``kv_indices`` are the engine's KV page ids of the request's logical pages in order;
``state_indices`` maps every other index kind the layout uses to its list, and
``"draft.KIND"`` to the draft's own lists (docs/indices.md has the semantics). A
request sent in chunks gives its KV pages chunk by chunk (:meth:`Sender.send_chunk`).

Every call is a frame on the attach socket (:mod:`kvbeam.engine.channel`):
``send``/``send_metadata``/``abort``/``release`` write one frame each (several in one
write inside ``attachment.channel.batch()``), ``poll()`` reads the state the channel's
reader thread applied from the daemon's pushes (no syscall, no RPC), ``wait()`` blocks
on it; ``attachment.channel.poll_many()`` returns every change at once. No gRPC, no
torch. A scheduler that is not the engine calls the daemons' gRPC API instead
(:class:`kvbeam.client.KvbeamClient`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from kvbeam.engine.attach import Attachment
from kvbeam.engine.channel import EngineChannel, RequestState
from kvbeam.errors import AttachError, TransferFailed
from kvbeam.pools.types import IndexKind
from kvbeam.proto import engine_frames as ef
from kvbeam.states import FailureReason, TransferState


class KVPoll(enum.IntEnum):
    """sglang's poll states, with sglang's integers."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_POLL = {
    TransferState.FAILED: KVPoll.Failed,
    TransferState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    TransferState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    TransferState.TRANSFERRING: KVPoll.Transferring,
    TransferState.SUCCESS: KVPoll.Success,
}


def poll_of(state: TransferState) -> KVPoll:
    """The KVPoll value of a kvbeam transfer state."""
    return _POLL[state]


def index_lists(kv_indices: Sequence[int] | Any,
                state_indices: Mapping[str, Sequence[int] | Any] | None) -> dict[str, Any]:
    """``kv_indices`` and ``state_indices`` as the client's mapping by kind name."""
    return {"KV_PAGES": kv_indices, **(state_indices or {})}


def _channel_of(daemon: Attachment | EngineChannel) -> EngineChannel:
    channel = daemon if isinstance(daemon, EngineChannel) else daemon.channel
    if channel is None:
        raise AttachError("this attachment has no engine channel (it was closed)", "channel")
    return channel


class _Request:
    """What both sides share: the engine channel, the request id, its state."""

    def __init__(self, daemon: Attachment | EngineChannel, request_id: str) -> None:
        self.channel = _channel_of(daemon)
        self.request_id = request_id
        self._started = False
        self._state: RequestState | None = None  # the channel's record of this request

    def _track(self) -> RequestState:
        if self._state is None or self._state.state.terminal:
            self._state = self.channel.track(self.request_id)
        return self._state

    def poll(self) -> KVPoll:
        """The last state the daemon pushed (an attribute read); Bootstrapping until the
        request was sent or reserved here."""
        state = self._state
        return KVPoll.Bootstrapping if state is None else _POLL[state.state]

    def wait(self, timeout: float) -> KVPoll:
        """Block until the request ends or ``timeout`` seconds pass; the state then."""
        if self._state is None:
            return KVPoll.Bootstrapping
        return poll_of(self.channel.wait(self._state, timeout))

    @property
    def refusal(self) -> str:
        """The daemon's last refusal of one of this request's frames (``field:
        message``; "" when none). A refused frame had no effect: the request is as the
        daemon holds it (``poll()``); Failed comes only when the daemon let go of it
        (docs/engine.md, "What Failed means")."""
        return self._state.refusal if self._state is not None else ""

    @property
    def detail(self) -> str:
        """The daemon's last detail of the request (e.g. its verification)."""
        return self._state.detail if self._state is not None else ""

    def failure(self) -> tuple[FailureReason | None, str] | None:
        """(reason, detail) when the request failed (as last pushed), else None."""
        s = self._state
        if s is not None and s.state is TransferState.FAILED:
            return s.reason, s.detail
        return None

    def failure_exception(self) -> None:
        """Raise :class:`~kvbeam.errors.TransferFailed` when the last poll saw Failed."""
        failed = self.failure()
        if failed is not None:
            reason = failed[0].value if failed[0] else "unknown"
            raise TransferFailed(f"request {self.request_id} failed: {reason}: {failed[1]}",
                                 reason=reason, detail=failed[1])

    def abort(self, detail: str = "aborted by the engine") -> None:
        """Abort the request on this side's daemon (it tells the peer)."""
        if self._started:
            self.channel.send(ef.Abort(self.request_id, detail))


class Sender(_Request):
    """Prefill's side of one request: send its KV (whole, or in chunks) to a decode daemon
    (``decode_address`` "": the decode whose reservation names the request,
    docs/protocol.md "Decode-initiated pairing")."""

    def __init__(self, daemon: Attachment | EngineChannel, request_id: str,
                 decode_address: str) -> None:
        super().__init__(daemon, request_id)
        self.decode_address = decode_address
        self._pages_sent = 0  # KV pages given so far by send_chunk (the next kv_offset)

    def send_chunk(self, kv_pages: Sequence[int] | Any, *, seq_len: int, final: bool = False,
                   state_indices: Mapping[str, Sequence[int] | Any] | None = None,
                   kv_offset: int | None = None, layers: int | None = None) -> KVPoll:
        """Send one chunk as soon as the engine has it: the KV pages it completes (the
        next ones of the request's KV_PAGES list; give a page once every token in it is
        computed, so a chunk that ends inside a page gives that page with the next); the
        final chunk brings the last pages and every other list whole
        (``state_indices``: the states, the metadata row, the draft's own lists).

        For an engine that learns its pages chunk by chunk (sglang's chunked prefill):
        the daemon writes each chunk's pages while the next is computed, and decode is
        Success once the final chunk landed (and was verified). Pieces go in order; an
        out-of-order, overlapping or malformed one is refused (the daemon's ERROR names
        the field; :attr:`refusal`). ``kv_offset``: where these pages start in the
        request's KV_PAGES list (default: after those sent so far).

        ``layers`` (an engine that sends each layer as it computes it): the pages sent
        so far are ready in the model's layers ``[0, layers)`` only, and the daemon
        writes those layers now. Call it again with more layers (``kv_pages`` empty);
        add the next chunk's pages once those before are ready in every layer (a chunk
        without ``layers`` is ready in every layer; the final chunk is).

        Raises:
            ValueError: states, or ``layers``, with the final chunk misplaced.
        """
        if state_indices and not final:
            raise ValueError("the other lists (state_indices) come with the final chunk")
        if final and layers is not None:
            raise ValueError("the final chunk is ready in every layer: it names no layers")
        target, draft = ef.split_lists(index_lists(kv_pages, state_indices))
        offset = self._pages_sent if kv_offset is None else kv_offset
        state = self._track() if not self._started else self._state
        self.channel.send(ef.Send(self.request_id, seq_len, self.decode_address, final,
                                  target, draft, kv_offset=offset, layers=layers))
        self._started = True
        self._pages_sent = offset + len(target[IndexKind.KV_PAGES])
        assert state is not None
        return _POLL[state.state]

    def send(self, kv_indices: Sequence[int] | Any,
             state_indices: Mapping[str, Sequence[int] | Any] | None = None, *,
             seq_len: int) -> KVPoll:
        """Send the whole request: its lists in one frame (in chunks: :meth:`send_chunk`)."""
        target, draft = ef.split_lists(index_lists(kv_indices, state_indices))
        state = self._track()
        self.channel.send(ef.Send(self.request_id, seq_len, self.decode_address, True,
                                  target, draft))
        self._started = True
        return _POLL[state.state]


class Receiver(_Request):
    """Decode's side of one request: reserve where it lands, poll, release."""

    def __init__(self, daemon: Attachment | EngineChannel, request_id: str,
                 prefill_address: str) -> None:
        super().__init__(daemon, request_id)
        self.prefill_address = prefill_address

    def reserve(self, kv_indices: Sequence[int] | Any,
                state_indices: Mapping[str, Sequence[int] | Any] | None = None, *,
                seq_len: int, kv_skip: int = 0) -> None:
        """Reserve the request at the engine's destination lists (checked by decode):
        one frame. A refusal shows as Failed (the daemon holds nothing of the request
        then; ``failure_exception`` says why), except a second reservation of a live
        request, which leaves that request as it was (:attr:`refusal`).

        ``kv_skip``: the request's leading KV pages this engine already holds (its
        prefix cache); ``kv_indices`` then names only the pages from there on, and
        prefill writes (and digests) only those.
        """
        target, draft = ef.split_lists(index_lists(kv_indices, state_indices))
        self._track()
        self.channel.send(ef.Reserve(self.request_id, seq_len, self.prefill_address,
                                     target, draft, kv_skip))
        self._started = True

    def decline(self, detail: str) -> None:
        """This engine will not load the request (it reserved nothing for it): decode's
        daemon tells prefill at once, which fails its send and frees its source instead
        of waiting out its lease.

        Raises:
            ValueError: the request was reserved here (abort it instead).
        """
        if self._started:
            raise ValueError(f"request {self.request_id} was reserved here: abort it instead")
        self.channel.send(ef.Decline(self.request_id, self.prefill_address, detail))

    send_metadata = reserve  # sglang's name for the same call

    def release(self) -> None:
        """The engine took the KV over: decode frees the reservation."""
        self.channel.send(ef.Release(self.request_id))
