"""The start-up check: a side refuses to start when its own pools cannot work."""

from __future__ import annotations

import logging

from kvbeam.errors import PoolCompatibilityError
from kvbeam.pools.checks import check_target_draft
from kvbeam.proto.side import SideInfo, side_to_proto

log = logging.getLogger(__name__)


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
