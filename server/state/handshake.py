"""Handshake verification: the one place that turns a peer's SideInfo into a VerifiedPeer.

Both ends of a handshake run :func:`verify_peer` on what they received: the
server on the request (:mod:`kvbeam.server.api.servicer`), the client on the reply or
on the server's rejection (:mod:`kvbeam.server.peers.client`). It runs
:func:`kvbeam.pools.checks.compare_sides` (which includes each side's own
target/draft checks), logs every difference and raises, or returns a
:class:`VerifiedPeer`.

"No transfer without a successful handshake" is a type: transfer APIs take a
:class:`VerifiedPeer`, and its constructor refuses any caller but
:func:`verify_peer` (it demands a private proof object), so holding one proves
that this process compared both layouts and found no difference.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from kvbeam.errors import (
    Difference,
    PoolCompatibilityError,
    ProtocolVersionError,
    RoleConflictError,
)
from kvbeam.logs import fields
from kvbeam.pools.checks import check_target_draft, compare_sides
from kvbeam.pools.layout import SideLayout
from kvbeam.proto.side import Role, SideInfo, side_to_proto
from kvbeam.transport.endpoint import Endpoint

log = logging.getLogger(__name__)


class _Proof:
    """Held only by this module: the constructor argument that makes a VerifiedPeer."""

    __slots__ = ()


_PROOF = _Proof()


class VerifiedPeer:
    """A peer whose handshake succeeded: its layout, endpoint and identity, checked.

    Only :func:`verify_peer` can construct one. Attributes are read-only.

    Attributes:
        side: the peer's SideInfo as decoded from the wire.
        local: our SideInfo as we sent it to this peer (``local.endpoint`` is the
            endpoint the peer will write to or connect to).
        address: where the peer was reached (client) or called from (server).
        verified_at: ``time.monotonic()`` of the verification.
    """

    __slots__ = ("_address", "_local", "_side", "_verified_at")

    def __init__(self, proof: object, side: SideInfo, local: SideInfo, address: str,
                 verified_at: float) -> None:
        if proof is not _PROOF:
            raise TypeError("a VerifiedPeer is created only by a successful handshake "
                            "(kvbeam.server.state.handshake.verify_peer)")
        self._side = side
        self._local = local
        self._address = address
        self._verified_at = verified_at

    @property
    def side(self) -> SideInfo:
        """The peer's side."""
        return self._side

    @property
    def local(self) -> SideInfo:
        """Our side, as sent to this peer."""
        return self._local

    @property
    def address(self) -> str:
        """The peer's network address as seen by this side."""
        return self._address

    @property
    def verified_at(self) -> float:
        """``time.monotonic()`` when the pair was verified."""
        return self._verified_at

    @property
    def role(self) -> Role:
        """The peer's role."""
        return self._side.role

    @property
    def instance_id(self) -> str:
        """The peer's instance id (changes when the peer restarts)."""
        return self._side.instance_id

    @property
    def control_address(self) -> str:
        """The peer's own control server address ("" if it runs none)."""
        return self._side.control_address

    @property
    def layout(self) -> SideLayout:
        """The peer's pool layout."""
        return self._side.layout

    @property
    def endpoint(self) -> Endpoint:
        """The peer's data-plane endpoint (connect to it / write into its regions)."""
        return self._side.endpoint

    @property
    def local_endpoint(self) -> Endpoint:
        """The endpoint we gave this peer."""
        return self._local.endpoint

    def with_local_endpoint(self, endpoint: Endpoint) -> VerifiedPeer:
        """The same verified peer with the endpoint we actually sent it.

        The server verifies first and only then creates the per-peer endpoint (an
        RDMA queue pair), so no link is created for a peer that gets refused.
        """
        local = dataclasses.replace(self._local, endpoint=endpoint)
        return VerifiedPeer(_PROOF, self._side, local, self._address, self._verified_at)

    def __repr__(self) -> str:
        return (f"VerifiedPeer(role={self.role.value}, instance_id={self.instance_id!r}, "
                f"address={self.address!r}, control_address={self.control_address!r}, "
                f"model={self.layout.model!r}, transport={self.endpoint.kind})")


def pair_differences(local: SideInfo, peer: SideInfo) -> list[Difference]:
    """:func:`compare_sides` with prefill and decode taken from the two sides' roles."""
    if local.role is Role.PREFILL:
        return compare_sides(local.layout, peer.layout)
    return compare_sides(peer.layout, local.layout)


def incompatibility_error(diffs: Sequence[Difference], peer_desc: str) -> PoolCompatibilityError:
    """The PoolCompatibilityError for a refused pair, listing every difference."""
    return PoolCompatibilityError(
        f"handshake with {peer_desc} refused: {len(diffs)} pool difference(s) between "
        "prefill and decode: " + "; ".join(d.message for d in diffs),
        list(diffs),
    )


def log_differences(logger: logging.Logger, headline: str, diffs: Sequence[Difference],
                    peer: str | None = None) -> None:
    """One ERROR line for the refusal, then one WARNING per difference (field named)."""
    extra = fields(peer=peer)
    logger.error("%s: %d pool difference(s)", headline, len(diffs), extra=extra)
    for i, d in enumerate(diffs, start=1):
        logger.warning("difference %d/%d: field=%s side=%s: %s", i, len(diffs), d.field, d.side,
                       d.message, extra=extra)


def describe(side: SideInfo, address: str) -> str:
    """A short name for a peer in messages: ``decode peer 3f2a... at 10.0.0.2:7000``."""
    return f"{side.role.value} peer {side.instance_id} at {address or '?'}"


def verify_peer(local: SideInfo, peer: SideInfo, *, address: str) -> VerifiedPeer:
    """Verify a peer against our side; the only way to obtain a :class:`VerifiedPeer`.

    Args:
        local: our side as we send it to this peer.
        peer: the peer's side, decoded from the wire.
        address: the peer's address, for messages and :attr:`VerifiedPeer.address`.

    Raises:
        ProtocolVersionError: the protocol versions differ.
        RoleConflictError: both sides have the same role.
        PoolCompatibilityError: the layouts differ; ``differences`` lists all of them.
    """
    who = describe(peer, address)
    extra = fields(peer=peer.control_address or address)
    if peer.protocol_version != local.protocol_version:
        log.error("handshake with %s refused: protocol version %d, ours %d", who,
                  peer.protocol_version, local.protocol_version, extra=extra)
        raise ProtocolVersionError(local.protocol_version, peer.protocol_version, origin=who)
    if peer.role is local.role:
        log.error("handshake with %s refused: both sides are %s", who, local.role.value,
                  extra=extra)
        raise RoleConflictError(
            f"handshake with {who} refused: both sides are {local.role.value}; a handshake "
            f"pairs a prefill daemon with a decode daemon", address=address)
    diffs = pair_differences(local, peer)
    if diffs:
        log_differences(log, f"handshake with {who} refused", diffs,
                        peer=peer.control_address or address)
        raise incompatibility_error(diffs, who)
    log.info("handshake with %s verified (model %s, %s transport)", who, peer.layout.model,
             peer.endpoint.kind, extra=extra)
    return VerifiedPeer(_PROOF, peer, local, address, time.monotonic())

def check_local_side(side: SideInfo) -> None:
    """Refuse to start with pools a peer would refuse anyway.

    Runs sglang's target/draft checks (:func:`check_target_draft`) on our own
    layout; the error message starts with sglang's text, e.g. "DSV4 target and
    draft pools must use the same unified-KV mode: ...", and lists every problem.
    Then encodes our SideInfo through the strict decoder, so a value the wire
    cannot carry fails here and not at the first handshake.

    Raises:
        PoolCompatibilityError: target and draft pools disagree.
        ProtocolError: our own metadata or endpoint cannot be sent.
    """
    try:
        check_target_draft(side.layout, side.role.value)
    except PoolCompatibilityError as exc:
        log.error("refusing to start: %s", exc)
        raise
    side_to_proto(side, validate=True)
