"""The kvbeam error hierarchy: every error kvbeam raises on purpose derives from
:class:`KvbeamError` and is defined here, so callers can catch one type and users
can search the message text in docs/troubleshooting.md; docs/errors.md tabulates every
class, where it is raised and its gRPC status.

This module imports no gRPC: the mapping between these classes and gRPC status
codes (both directions) is :mod:`kvbeam.rpc_errors`. docs/errors.md lists every
class, where it is raised and its status code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: this module imports no other kvbeam module
    from kvbeam.states import FailureReason


class KvbeamError(Exception):
    """Base class of every error kvbeam raises on purpose."""


class ConfigError(KvbeamError, ValueError):
    """A pool spec or daemon config that cannot be built; the message names the field."""


class PoolCompatibilityError(KvbeamError):
    """Target and draft pools of one side, or the pools of prefill and decode, differ.

    ``differences`` lists every difference found, not only the first.
    """

    def __init__(self, message: str, differences: list[Difference] | None = None) -> None:
        super().__init__(message)
        self.differences: list[Difference] = list(differences or [])


@dataclass(frozen=True)
class Difference:
    """One field on which two pool layouts differ.

    ``side`` says whose pools the field belongs to: ``prefill`` or ``decode`` for a
    target/draft difference within one side, ``prefill/decode`` for a difference
    across sides. ``values`` pairs each party with its value, e.g.
    ``(("target", "True"), ("draft", "False"))`` or ``(("prefill", "128"), ("decode", "256"))``.
    ``message`` is the full sentence (it starts with sglang's wording where one exists).
    """

    field: str
    side: str
    values: tuple[tuple[str, str], ...]
    message: str


class PlanError(KvbeamError, ValueError):
    """A transfer plan cannot be built: an index out of range, a length or item-length mismatch."""


class TransportError(KvbeamError):
    """A data-plane failure. ``status`` carries the verbs work-completion status where known."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


class RegionError(TransportError):
    """A block falls outside every registered local or remote region; nothing was posted."""


# --- the wire protocol (kvbeam.proto) ---

class ProtocolError(KvbeamError):
    """A protobuf message that kvbeam refuses to decode (or a value it cannot encode).

    ``field`` is the dotted path of the offending field, e.g.
    ``side.metadata.components[2].buffers[0].item_len``; ``problem`` says what is
    wrong with it. ``origin`` (optional) says where the message came from.
    """

    def __init__(self, field: str, problem: str, *, origin: str = "") -> None:
        self.field = field
        self.problem = problem
        self.origin = origin
        prefix = f"{origin}: " if origin else ""
        super().__init__(f"{prefix}{field}: {problem}")

    def from_origin(self, origin: str) -> ProtocolError:
        """The same error, saying where the message came from (e.g. the peer's address)."""
        return ProtocolError(self.field, self.problem, origin=origin)


class ProtocolVersionError(ProtocolError):
    """The peer speaks another kvbeam protocol version than this side."""

    def __init__(self, local: int, remote: int, *, field: str = "protocol_version",
                 origin: str = "") -> None:
        self.local = local
        self.remote = remote
        super().__init__(
            field,
            f"protocol version mismatch: this side speaks kvbeam protocol version {local}, "
            f"the peer speaks {remote}; run the same kvbeam protocol version on both sides",
            origin=origin,
        )

    def from_origin(self, origin: str) -> ProtocolVersionError:
        """The same error, saying where the message came from."""
        return ProtocolVersionError(self.local, self.remote, field=self.field, origin=origin)


# --- the control plane: reaching and talking to a peer ---

class PeerError(KvbeamError):
    """Talking to a peer's control server failed.

    ``address`` is the peer's control address; ``code`` the gRPC status name
    (e.g. ``DEADLINE_EXCEEDED``) when the failure came from gRPC.
    """

    def __init__(self, message: str, *, address: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.code = code


class PeerTimeoutError(PeerError):
    """The peer did not answer within the deadline (silent, overloaded or not a gRPC server)."""


class PeerUnavailableError(PeerError):
    """The peer cannot be reached (connection refused, reset, DNS failure)."""


class NotKvbeamPeerError(PeerError):
    """Something answers at the address, but it is not a kvbeam v1 control server."""


class AuthenticationError(PeerError):
    """The peer refused our credentials (UNAUTHENTICATED), or the TLS handshake failed.

    Neither side learned anything from the other: the refusal comes before any
    servicer code runs (token) or before any RPC exists (mTLS).
    """


class HandshakeRejectedError(PeerError):
    """The peer refused the handshake for a reason other than pool differences or version,
    e.g. it found our metadata malformed. ``field`` names the field it objected to."""

    def __init__(self, message: str, *, address: str = "", code: str | None = None,
                 field: str = "") -> None:
        super().__init__(message, address=address, code=code)
        self.field = field


class RoleConflictError(PeerError):
    """Both sides of a handshake have the same role (two prefills or two decodes)."""


class NotHandshakenError(KvbeamError):
    """A transfer names a peer instance that has no successful handshake with this side."""


class ListenError(KvbeamError):
    """The control server cannot listen on the requested address."""


# --- transfer requests (the daemons' RPC handlers and their lifecycle) ---

class UnknownRequest(KvbeamError):
    """A request id this side does not know (never created, or forgotten long ago)."""


class BadRequest(KvbeamError):
    """A request message that is well-formed protobuf but asks for something invalid."""


class SendFailed(KvbeamError):
    """A prefill send step failed; ``reason`` is the lifecycle failure reason to report.

    ``peer_lost``: the peer no longer knows us (it restarted or dropped our link): every
    request on that connection fails, not only this one. Internal to prefill: it ends
    the request as ``Failed(reason)`` and never reaches a caller.
    """

    def __init__(self, reason: FailureReason, message: str, *, peer_lost: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.peer_lost = peer_lost


class NotReserved(SendFailed):
    """Decode has no reservation for the request (yet): its BeginWrite was refused
    UnknownRequest. Prefill then waits for decode's reservation (``--send-wait-s``)."""


class DialRefused(KvbeamError):
    """Decode asked a prefill daemon to handshake with it (decode-initiated pairing) and
    it could not: ``reason`` is the failure reason decode's reservations naming that
    prefill end with (incompatible: prefill's handshake was refused; peer_unreachable:
    prefill, or decode from prefill, could not be reached). ``retry``: nothing is known
    to be wrong with the pair (an older prefill without Connect, prefill busy, the data
    link not connectable through a partition): the reservations wait for the Send's
    handshake or their deadline instead of failing."""

    def __init__(self, reason: FailureReason, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry = retry


class NotPosted(KvbeamError):
    """A write of a request could not be posted on its link (``cause``, the transport's
    error). Internal to prefill's core: the step that meets it resends the request on a
    new link (a transient transport error) or fails it with ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class IllegalTransition(KvbeamError):
    """A state change the lifecycle does not allow (e.g. SUCCESS -> TRANSFERRING)."""


class AlreadyLanded(IllegalTransition):
    """BeginWrite on a new link for a request that already landed and was verified.

    Decode's answer to prefill's resend when the failed attempt's bytes had in fact
    arrived (only the acknowledgements were lost): prefill ends the request as a
    Success instead of writing it again.
    """


class DuplicateRequest(KvbeamError):
    """A request id already known on this side (per peer pair ids must be unique)."""


class TooManyTransfers(KvbeamError):
    """The bounded transfer table is full: back-pressure, try later."""


class NoFreeSlot(KvbeamError):
    """Every request slot is held: the scheduler must wait (RESOURCE_EXHAUSTED)."""


class Busy(KvbeamError):
    """RESOURCE_EXHAUSTED: no free slot or too many transfers in flight; retry later."""


class NoDaemon(KvbeamError):
    """Scheduler (:mod:`kvbeam.fleet`): every daemon of a role is unreachable, set aside,
    or (decode) full; nothing is sent."""


# --- processes ---

class DaemonStartError(KvbeamError):
    """A daemon process exited or did not report ready in time; ``output`` has its log."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(f"{message}\n--- daemon output ---\n{output}")
        self.output = output


# --- engine attach (kvbeam.engine, kvbeam.server.engines.attach) ---

class NoEngineAttached(KvbeamError):
    """A ``--pools engine`` daemon has no engine memory attached: it refuses transfers
    (FAILED_PRECONDITION) and answers NOT_SERVING on health until an engine attaches."""


class FrameError(KvbeamError):
    """An engine-channel or peer-channel frame refused (:mod:`kvbeam.proto.engine_frames`,
    :mod:`kvbeam.server.peers.channel`); ``field``
    names the part at fault (``length``, ``lists[1].kind``, ...)."""

    def __init__(self, field: str, problem: str, request_id: str = "") -> None:
        self.field = field
        self.problem = problem
        self.request_id = request_id
        super().__init__(f"{field}: {problem}")


class RecordError(KvbeamError, ValueError):
    """A digest record in decode's mailbox that fails a check: ``field`` names it,
    ``detail`` gives both values (:mod:`kvbeam.pools.mailbox`)."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"digest record: {field}: {detail}")
        self.field = field
        self.detail = detail


class AttachError(KvbeamError):
    """An engine's attach was refused (by the daemon, or before sending); ``field`` names
    the part of the attach description at fault ("" when none)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


# --- engine-chosen index lists ---

class BadKvSkip(BadRequest):
    """A ``kv_skip`` (leading KV pages decode holds, not written) refused: negative,
    past the request's pages, without the engine's lists, or on a layout where it has no
    meaning (INVALID_ARGUMENT, as BadRequest; the engine channel's ERROR names
    ``kv_skip``)."""

    field = "kv_skip"


class BadIndexList(BadRequest):
    """An engine's index list refused before any byte moved (INVALID_ARGUMENT, as BadRequest).

    ``side`` ("prefill" or "decode"), ``kind`` (an IndexKind value or "" when the
    kind itself is unknown), ``pool`` ("target" or "draft") and, for a bad index,
    its ``position`` in the list and its ``index`` (-1 when the list as a whole is wrong).
    """

    def __init__(self, message: str, *, side: str, kind: str, pool: str = "target",
                 position: int = -1, index: int = -1) -> None:
        super().__init__(message)
        self.side = side
        self.kind = kind
        self.pool = pool
        self.position = position
        self.index = index


class TransferFailed(KvbeamError):
    """A transfer ended Failed(reason, detail): what ``failure_exception`` of kvbeam.engine raises.

    ``reason`` is the FailureReason value (e.g. ``"integrity"``), ``detail`` the daemon's text.
    """

    def __init__(self, message: str, *, reason: str, detail: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.detail = detail


class SglangMismatch(KvbeamError):
    """sglang's internals are not where kvbeam's sglang backend selection expects them
    (:mod:`kvbeam.integrations.sglang.select`; the message names the expected version)."""


class PeerChannelError(KvbeamError):
    """A call on the peer channel (:mod:`kvbeam.server.peers.channel`) refused, closed or
    timed out, or a channel request refused by its handler; shaped like a failed gRPC call
    (``code()`` is a ``grpc.StatusCode``, untyped here: this module imports no gRPC), so
    the callers' mapping of RPC failures applies unchanged."""

    def __init__(self, code: Any, details: str, in_flight: int = 0) -> None:
        super().__init__(f"{getattr(code, 'name', code)}: {details}")
        self._code = code
        self._details = details
        self.in_flight = in_flight

    def code(self) -> Any:
        """The status code (a ``grpc.StatusCode``)."""
        return self._code

    def details(self) -> str:
        """The status details."""
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """None: the channel's answer has no metadata."""
        return ()


class StagingFull(KvbeamError):
    """An engine's staging buffer (:mod:`kvbeam.engine.staging`) had no room for a
    request within its wait; ``policy`` (``"fail"`` or ``"recompute"``) is what the
    engine was configured to do then."""

    def __init__(self, message: str, *, policy: str) -> None:
        super().__init__(message)
        self.policy = policy
