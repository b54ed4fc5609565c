"""The actions both cores return: a link to release, a metric to count.

Each role's own actions are in :mod:`kvbeam.server.core.decode_actions` and
:mod:`kvbeam.server.core.prefill_actions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.transport import Event


@dataclass(frozen=True)
class DropLink:
    """Remove the peer connection and release its link (no write can land over it
    after); then the core's ``link_dropped`` (decode's
    :meth:`~kvbeam.server.core.decode.DecodeCore.link_dropped`, prefill's
    :meth:`~kvbeam.server.core.prefill_events.PrefillEvents.link_dropped`). ``gone``:
    the peer itself is lost (its requests fail), not only this link."""

    conn: PeerConn
    detail: str
    gone: bool


@dataclass(frozen=True)
class Count:
    """Count one event on a daemon metric: decode's ``offers`` (``label``: made,
    refused, failed) and ``declines``, prefill's ``resends``."""

    metric: str
    label: str = ""


def link_failure(peers: Peers, event: Event) -> DropLink | None:
    """What either core does about a LINK_FAILED event: drop that link, keeping the
    peer (only the link died; the requests on it are resent or told). None when no
    connection uses the link any more."""
    conn = peers.by_link(event.link)
    if conn is None:
        return None
    return DropLink(conn, f"link failed: {event.status}: {event.detail}", gone=False)
