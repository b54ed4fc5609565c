"""The transfer state vocabulary every layer speaks: states, failure reasons, statuses.

States follow sglang's poll states::

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
          \\________________\\__________________\\______-> FAILED(reason, detail)

The daemons keep the books (:mod:`kvbeam.server.state.lifecycle`: legal transitions,
deadlines, the transfer table); the wire codec (:mod:`kvbeam.proto.transfer_codec`)
and the public client speak these values without importing the daemons.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: How decode's Success detail starts when every moved buffer's XXH3-128 matched prefill's.
VERIFIED_PREFIX = "XXH3-128 verified:"
#: Decode's Success details when the bytes were not verified (the completion proved arrival).
NOT_VERIFIED_OFF = "bytes not verified: integrity is off on decode (KVBEAM_INTEGRITY=false)"
NOT_VERIFIED_NO_DIGESTS = "bytes not verified: prefill sent no digests (its integrity is off)"


class TransferState(enum.Enum):
    """Where a transfer is, on either side."""

    #: True for SUCCESS and FAILED. A plain attribute of each member, set once: every
    #: state change and status read asks (some 10-20 times per small request in a
    #: daemon), and a property would be a Python call each time.
    terminal: bool

    BOOTSTRAPPING = "Bootstrapping"
    WAITING_FOR_INPUT = "WaitingForInput"
    TRANSFERRING = "Transferring"
    SUCCESS = "Success"
    FAILED = "Failed"

    # Members are singletons: identity hashing (C) instead of Enum's hash of the name (a
    # Python call per dict lookup, some 200-300 per small request in a daemon's lists).
    __hash__ = object.__hash__

    def __init__(self, value: str) -> None:
        self.terminal = value in ("Success", "Failed")


class FailureReason(enum.Enum):
    """Why a transfer failed (the ``reason`` of ``Failed(reason, detail)``)."""

    ABORTED = "aborted"
    TIMEOUT = "timeout"
    PEER_FAILED = "peer_failed"
    PEER_UNREACHABLE = "peer_unreachable"
    TRANSPORT_ERROR = "transport_error"
    INCOMPATIBLE = "incompatible"
    INTEGRITY = "integrity"
    INVALID_REQUEST = "invalid_request"
    SHUTDOWN = "shutdown"

    # Members are singletons: identity hashing (C) instead of Enum's hash of the name (a
    # Python call per dict lookup, some 200-300 per small request in a daemon's lists).
    __hash__ = object.__hash__


@dataclass(frozen=True)
class TransferStatus:
    """What Status/WatchStatus report."""

    request_id: str
    peer: str
    state: TransferState
    reason: FailureReason | None
    detail: str
    version: int
    age_s: float
    nbytes: int = 0  # bytes the transfer moved, once it is SUCCESS (for metrics)


@dataclass(frozen=True)
class TransferFacts:
    """What one side's request moves, from its plan: ``kvbeam status`` and the line a
    daemon logs when a transfer ends. A daemon keeps them after the request ends.

    Prefill: ``bytes_done`` written (completed writes) of ``bytes_total`` posted;
    decode: ``bytes_done`` landed of ``bytes_total`` reserved.
    """

    bytes_done: int = 0
    bytes_total: int = 0
    #: Each index list's length, by kind name ("draft.KIND": the draft's own list), in
    #: the order of :class:`kvbeam.pools.types.IndexKind`.
    lists: tuple[tuple[str, int], ...] = ()
    #: Leading KV pages decode holds (a prefix-cache hit): not written.
    kv_skip: int = 0
    #: Whether and how the bytes are (or were) verified, in words.
    verification: str = ""
