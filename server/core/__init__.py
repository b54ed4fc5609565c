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

Threads. The daemon (``DaemonServicer``) owns ONE bounded executor
(``ThreadPoolExecutor``, ``IO_WORKERS`` threads); every blocking step runs there:
handshakes, XXH3-128 digests, peer calls (BeginWrite, Abort: each waits for its
answer on the pair's peer channel), link releases. Decode's Offer (the core's
``SendOffer`` action) does not block: its driver sends it on the loop, outside every
lock, and prefill's answer, when it sends one (a kept offer gets none), is an event
handled on the daemon's loop (``DecodeCore.answer_arrived``).

**The cores are called on the daemon's loop only** (:mod:`kvbeam.loop`: the peer
channels, the attach socket and the engine channel, the transport, the deadline
sweep). A gRPC handler, an executor job or the ``peer_io`` pool hands its call into
a core to the loop and waits for it (``DriverBase.on_loop``; the drivers' ``_event``
hands over an event and its actions): the core's calls never run on two threads at
once. ``on_event`` runs on the loop with no transport lock held: it does
bookkeeping, verifies a small landing on decode (its digests run inline anyway) and
submits the rest. A prefill step that cannot block (a small request written whole with
decode's offer in hand, or a later piece of a request in pieces under its first piece's
grant) runs on the loop where its request became ready (``PrefillCore.steps_inline``);
what follows an action that blocks goes to the executor in order
(``PrefillDriver.execute``), and its next call into the core comes back to the loop.
Nothing starts a thread per event. **The cores take no lock**:
every request record, the write and transfer-id maps, the pending-handshake waiters,
prefill's offer book and decode's page book (:mod:`~kvbeam.server.core.decode_pages`)
are the loop's alone. The one signal a core gives another thread: prefill's Abort
handler, off the loop, waits a bounded while for a request's writes to drain on a
``threading.Event`` from :meth:`PrefillCore.watch_drain`, which the loop sets once
they did (its ``_abort_waiters`` counter is taken without blocking: a full counter
means: answer without waiting). A decode Abort's caller check (which may resolve a
host name) runs on the handler's thread, before its call into the core.

Locks in kvbeam.server, and their order (a lock may be taken while holding one
listed ABOVE it, never the reverse). No lock is held across I/O: a handshake, an
RPC, a digest, a write post, a link's release or a memory registration.

1. ``server.core.base._AFTER_LOOP`` (reentrant), taken only after a daemon's loop
   stopped: shutdown's stragglers (an executor job finishing, the last end-log lines)
   call into the core one at a time under it, as the loop would have run them.
2. ``TransferTable._cond`` (:mod:`kvbeam.server.state.lifecycle`): the lifecycle states.
   Its ``on_change`` callback (metrics) runs after the lock is released.
3. ``PrefillDriver._dial_lock`` (the handshakes under way), which looks up
   ``Peers`` and the connection found (their locks, leaves) and calls nothing else
   while held.
4. Leaves, which call nothing while held: ``Peers._lock``
   (:mod:`kvbeam.server.state.peers`), ``PeerConn._lock`` (``closed``; ``close`` releases
   the link after it), ``SlotPool`` (:mod:`kvbeam.server.state.slots`),
   ``DecodeServicer._links_lock`` (handshake links), ``DaemonServicer._watch_lock``,
   ``FaultHooks._lock``, ``ControlServer._lock`` (start/stop only), the peer
   channels' ``PeerChannel._wlock`` (a channel's outbound buffer and calls; held
   across a non-blocking ``send`` only) and ``PeerChannels._lock`` (the selector's
   queues), and the metrics' own locks. ``PeerConn.close`` closes its peer channel
   after releasing ``PeerConn._lock``.
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
