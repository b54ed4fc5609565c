"""The actions both cores return (a link to release, a metric to count), and how
every action names a request's record (:class:`RecordRef`).

Each role's own actions are in :mod:`kvbeam.server.core.decode_actions` and
:mod:`kvbeam.server.core.prefill_actions`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.transport import Event


@dataclass(frozen=True, slots=True)
class RecordRef:
    """How actions, the drivers and their events name a request's record (prefill's
    :class:`~kvbeam.server.core.outgoing.Outgoing`, decode's
    :class:`~kvbeam.server.core.incoming.Incoming`): its id and which record of that id
    it is (an id may come again once its record was forgotten), so an event of a
    forgotten request never reaches a newer one. Never the record itself, which only
    the loop reads and writes."""

    request_id: str
    serial: int


_serials = itertools.count(1)


def new_ref(request_id: str) -> RecordRef:
    """A new record's ref (each record its own serial)."""
    return RecordRef(request_id, next(_serials))


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
