"""The daemons' gRPC-free cores: one object per role owns every request's state.

:class:`~kvbeam.server.core.prefill.PrefillCore` and
:class:`~kvbeam.server.core.decode.DecodeCore` keep ONE record per request (its
lifecycle state in the shared :class:`~kvbeam.server.state.lifecycle.TransferTable`, the
single state vocabulary) and are driven by events: API calls (reserve, send,
begin_write, abort, release, status), transport events (:meth:`on_event`),
deadlines (:meth:`on_deadline`), peer loss (:meth:`on_peer_lost`) and a periodic
sweep. A link that fails under a request is not the end of it: prefill resends it
on a new link (:mod:`kvbeam.server.core.resend`; the handshake and BeginWrite run on
the executor like a first send's) and decode keeps it meanwhile. Nothing here
imports gRPC (a unit test checks): the servicers are thin adapters, and peer calls
reach a core through the protocols in :mod:`kvbeam.server.core.ports`, implemented
over the peer channel by :mod:`kvbeam.server.peers.calls`. An engine can drive a core
directly.
Modules, by responsibility: :mod:`~kvbeam.server.core.base` (status and the
engine-pools switch, both cores), :mod:`~kvbeam.server.core.actions` (the actions both
return: a link to drop, a metric to count). Both cores are plain state machines:
every API call, transport event, peer answer, post outcome and tick is an event, each
returns actions, and neither does I/O (no executor, peer client, digest pool or
clock: ``now`` is an argument; a unit test reads each core's imports). Each has a
driver, what the daemon calls, that does every action and hands what comes of it back
to the core as its next event. Prefill: :mod:`~kvbeam.server.core.outgoing` (the
request record and its send path's one explicit phase, :class:`Step`: pure, no lock,
no I/O), :mod:`~kvbeam.server.core.prefill` (the core: the API, decode's offers, the
send path's decisions: connect, ask for a grant, plan and cut the writes, book them),
:mod:`~kvbeam.server.core.prefill_events` (its handlers of completions, failures,
deadlines, a lost peer, resends, the sweep), the actions
:mod:`~kvbeam.server.core.prefill_actions`, the driver
:mod:`~kvbeam.server.core.prefill_driver` (``PrefillDriver``: handshakes, BeginWrite,
digests, posts, Aborts, link releases, the Abort handler's bounded wait for a drain),
and the collaborators the core holds: :mod:`~kvbeam.server.core.offers` (``OfferBook``,
decode's reservations ahead of Send), :mod:`~kvbeam.server.core.prefill_record`
(``RecordStager``: the digest record's staging slots, written into decode's mailbox
before the completion marker) and :mod:`~kvbeam.server.core.resend`
(``ResendPolicy``). Decode: :mod:`~kvbeam.server.core.incoming` (the request record
and its landing's one explicit phase, :class:`Landing`: pure),
:mod:`~kvbeam.server.core.decode` (the core, returning
:mod:`~kvbeam.server.core.decode_actions`), :mod:`~kvbeam.server.core.decode_pages`
(no item in two live reservations); its driver
:mod:`~kvbeam.server.core.decode_driver` (``DecodeDriver``) with
:mod:`~kvbeam.server.core.decode_landing` (``LandingCheck``: the digest record and
the landed bytes' digests, the driver's I/O).
Each request's phase is its record's, moved only by its methods; its lifecycle state
(what engines and schedulers see) is the table's.

The threads around the cores (one loop calls them; the executor runs what blocks) and
the lock order of kvbeam.server are in docs/concurrency.md; the loop, the records'
states and the actions in docs/architecture.md.
"""

from kvbeam.server.core.decode import DecodeCore
from kvbeam.server.core.incoming import Incoming, Landing
from kvbeam.server.core.outgoing import Outgoing, Step
from kvbeam.server.core.ports import (
    DecodePeers,
    PrefillPeers,
    WriteGrant,
)
from kvbeam.server.core.prefill import PrefillCore
from kvbeam.server.core.prefill_driver import PrefillDriver

__all__ = ["DecodeCore", "DecodePeers", "Incoming", "Landing", "Outgoing",
           "PrefillCore", "PrefillDriver", "PrefillPeers", "Step", "WriteGrant"]
