"""What the cores need from the outside, as plain Python: peer calls, errors, grants.

The cores (:mod:`kvbeam.server.core.prefill`, :mod:`kvbeam.server.core.decode`)
decide; the daemon's driver does the I/O. Peer calls reach the cores through the
two small protocols here, implemented over the peer channel (and gRPC for the
handshake and Connect) by :mod:`kvbeam.server.peers.calls` and by fakes in the unit
tests. Their methods block (a handshake, an answer on the channel) and are only ever
called on the driver's bounded executor, never on the daemon's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvbeam.errors import UnknownRequest
from kvbeam.pools.types import INDEX_KINDS, IndexKind
from kvbeam.server.state.lifecycle import TransferTable
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import TransferStatus

IndexLists = dict[IndexKind, npt.NDArray[np.int64]]
Call = TypeVar("Call")

log = logging.getLogger(__name__)

#: Deadline of the Aborts a core sends at shutdown or detach, all at once, s: with
#: hundreds of live requests and a peer that does not answer, the whole shutdown still
#: fits a 30 s termination grace period.
SHUTDOWN_ABORT_S = 1.0


def list_lengths(indices: IndexLists, draft: IndexLists) -> tuple[tuple[str, int], ...]:
    """Each non-empty index list's length by kind name, the draft's own as "draft.KIND"
    (what ``kvbeam status`` shows), in IndexKind order. A kind the layout does not use
    has an empty list: left out."""
    out = [(k.value, len(indices[k])) for k in INDEX_KINDS if k in indices and len(indices[k])]
    out += [(f"draft.{k.value}", len(draft[k])) for k in INDEX_KINDS
            if k in draft and len(draft[k])]
    return tuple(out)


def require_status(table: TransferTable, request_id: str, side: str) -> TransferStatus:
    """The request's status; UnknownRequest when ``side`` does not know it."""
    snap = table.get(request_id)
    if snap is None:
        raise UnknownRequest(f"unknown request id {request_id!r} on this {side} daemon")
    return snap


def abort_at_shutdown(calls: Sequence[Call], detail: str, whom: str,
                      abort_all: Callable[[Sequence[Call], str, float], int],
                      clock: Callable[[], float]) -> None:
    """Tell the peer side of every live request in ``calls`` at once (``abort_all``,
    within ``SHUTDOWN_ABORT_S`` in all) and log how it went; ``whom``: "decode" or
    "prefill"; ``clock``: the driver's. Blocking: the caller's shutdown or detach, off
    the loop."""
    if not calls:
        return
    began = clock()
    confirmed = abort_all(calls, detail, SHUTDOWN_ABORT_S)
    log.info("%s: told %s of %d live request(s) in %.2f s, %d confirmed", detail, whom,
             len(calls), clock() - began, confirmed)


@dataclass(frozen=True)
class WriteGrant:
    """Decode's answer to BeginWrite: the transfer id and where to write."""

    transfer_id: int
    indices: IndexLists
    draft: IndexLists = field(default_factory=dict)  # the draft's own lists, where given
    #: Leading KV pages of the request decode holds: ``indices``' KV_PAGES starts there.
    kv_skip: int = 0
    #: The request's slot of decode's digest mailbox (where its digest record goes).
    mailbox_slot: int = 0


class Offered(Enum):
    """Prefill's answer to decode's Offer of a reservation."""

    DIGESTS_FOLLOW = "digests_follow"  # kept; prefill's integrity is on
    NO_DIGESTS = "no_digests"          # kept; prefill's integrity is off
    REFUSED = "refused"                # not kept, for sure: prefill will ask BeginWrite
    UNKNOWN = "unknown"                # an unexpected status in its answer: it may be kept

    @property
    def kept(self) -> bool:
        """Prefill kept the offer: its Send writes without BeginWrite."""
        return self in (Offered.DIGESTS_FOLLOW, Offered.NO_DIGESTS)


class DecodePeers(Protocol):
    """Prefill's calls to decode daemons (blocking; run on the executor only)."""

    def connect(self, address: str) -> PeerConn:
        """Handshake with the decode daemon at ``address`` and connect a link to it."""

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int,
                    digests_follow: bool) -> WriteGrant:
        """Ask decode where (a chunk of) a request goes (no offer for it was kept).

        ``digests_follow``: prefill's integrity is on; the final chunk's last write is
        the request's digest record, into decode's mailbox slot (``mailbox_slot``).

        Raises:
            SendFailed: decode refused (with the reason to report).
            PeerError: decode could not be reached.
        """

    def reaches(self, conn: PeerConn | None, address: str) -> bool:
        """Whether an Abort to the decode at ``address`` has an open peer channel to go
        on (``conn``'s, or the pair's newer connection's)."""

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Tell decode a request failed here (best effort, over an open peer channel
        only); True when decode confirmed."""

    def abort_all(self, calls: Sequence[tuple[PeerConn | None, str, str]], detail: str,
                  timeout: float) -> int:
        """Tell decode of many failed requests (connection or None, address, request id)
        at once, all within ``timeout`` (shutdown, detach); returns how many confirmed."""


class PrefillPeers(Protocol):
    """Decode's calls to prefill daemons (never under a lock; all but :meth:`offer`
    block, and run on the executor)."""

    def offer(self, conn: PeerConn, request_id: str, seq_len: int, grant: WriteGrant,
              lease_s: float) -> bool:
        """Push a reservation to prefill ahead of its Send, one-way; returns at once,
        True when it was sent (False: no channel, nothing sent).

        Prefill keeps an offer without a word; what decode must act on (not kept, kept
        without digests, a refusal) comes later as an answer to
        :meth:`~kvbeam.server.core.decode.DecodeCore.answer_arrived`. After a refusal
        prefill asks with BeginWrite, as without an offer. Never raises.
        """

    def abort(self, conn: PeerConn, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort a request on prefill; True when prefill confirmed none of its writes is
        in flight (it answers within ``timeout``, and says so by Abort later if not)."""

    def connect_back(self, address: str, request_ids: Sequence[str] = ()) -> str:
        """Ask the prefill daemon at ``address`` to handshake with us (its Connect):
        returns its instance id once it did; the connection is then registered here
        (the handshake's server side). ``request_ids``: the requests waiting for the
        pair, which prefill ends itself if its handshake is refused. Decode-initiated
        pairing (docs/protocol.md).

        Raises:
            DialRefused: prefill answered why it could not (its handshake was refused,
                it cannot reach us, it has no engine), or could not be reached.
        """

    def abort_all(self, calls: Sequence[tuple[PeerConn, str]], detail: str,
                  timeout: float) -> int:
        """Abort many requests (connection, request id) at once, all within ``timeout``
        (shutdown, detach); returns how many prefill confirmed."""
