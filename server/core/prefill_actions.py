"""What prefill's event handlers ask of the I/O around them: one small class each.

:class:`~kvbeam.server.core.prefill_events.PrefillEvents` (completions, failures,
deadlines, a lost link or peer, resends, the sweep) decides and returns these;
:class:`~kvbeam.server.core.prefill.PrefillCore`'s ``_execute`` does them. With
:class:`~kvbeam.server.core.actions.DropLink` and
:class:`~kvbeam.server.core.actions.Count`, both roles' own.

Where each runs: :class:`TellDecode`, :class:`RunStep` and ``DropLink`` block (a
peer call, a step's handshake or BeginWrite, a link's release) and always run on the
executor; ``Count`` runs on the thread that handled the event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbeam.server.core.actions import Count, DropLink
from kvbeam.server.peers import PeerConn

if TYPE_CHECKING:
    from kvbeam.server.core.outgoing import Outgoing


@dataclass(frozen=True)
class TellDecode:
    """Abort the request on its decode (``conn``, or a new call to ``address`` when
    there is no live connection): prefill failed it and none of its writes is in
    flight. Best effort: nothing waits on the answer."""

    conn: PeerConn | None
    address: str
    request_id: str
    detail: str


@dataclass(frozen=True)
class RunStep:
    """Run the request's step, which the handler moved to RUNNING (its resend on a new
    link: a handshake, BeginWrite, the writes)."""

    rec: Outgoing


PrefillAction = TellDecode | RunStep | DropLink | Count
Actions = list[PrefillAction]
