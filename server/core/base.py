"""What both cores share: their pools (the daemon's own or an engine's) and status.

:class:`CoreBase` is the base of :class:`~kvbeam.server.core.prefill.PrefillCore`
and :class:`~kvbeam.server.core.decode.DecodeCore`: one place for the status
accessor and for taking up or refusing pools (a core starts without any). Failing
what was live first is the caller's (each role's driver): it is I/O (peers are told).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

from kvbeam.loop import DaemonLoop
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.sub_batches import buffer_bytes
from kvbeam.server.core.attached import PoolsHolder
from kvbeam.server.core.ports import IndexLists, require_status
from kvbeam.server.state.lifecycle import TransferTable
from kvbeam.server.state.peers import Peers
from kvbeam.states import TransferFacts, TransferStatus

T = TypeVar("T")

#: Longest a thread waits for the daemon's loop to run its call into the core, s (the
#: loop runs it at its next pass: this bounds only a loop that stopped serving).
LOOP_CALL_TIMEOUT_S = 60.0

#: Serialises the calls into a core that come after its daemon's loop stopped (a leaf,
#: reentrant: a call may hand over another; nothing else is taken under it).
_AFTER_LOOP = threading.RLock()


def request_bytes(layout: SideLayout, indices: IndexLists, draft: IndexLists) -> int:
    """The bytes a whole request moves: every buffer's items of its list (the draft's own
    list for a draft buffer that has one)."""
    return sum(buffer_bytes(layout, indices, draft))


class CoreBase(PoolsHolder, ABC):
    """The status accessor and the engine-pools switch of a core (state is the core's)."""

    table: TransferTable
    peers: Peers
    #: "prefill" or "decode", for the UnknownRequest message.
    role: str = ""

    def status(self, request_id: str) -> TransferStatus:
        """The request's status."""
        return require_status(self.table, request_id, self.role)

    def facts_of(self, request_id: str) -> TransferFacts:
        """What the request moves: from its record while the core has one, else what the
        table kept when the core forgot it (nothing known: all zero)."""
        live = self._facts(request_id)
        if live is not None:
            return live
        return self.table.facts(request_id) or TransferFacts(
            verification=self._verification(None))

    @abstractmethod
    def _facts(self, request_id: str) -> TransferFacts | None:
        """The facts of the request's live record; None without one."""

    @abstractmethod
    def _verification(self, request_id: str | None) -> str:
        """How this side verifies (or verified) the request's bytes, in words."""

    def _adopt(self, spec: PoolSpec, layout: SideLayout) -> None:
        """Size the core's own state for the pools' config (decode: its slots)."""

    def take_pools(self, spec: PoolSpec, layout: SideLayout, pools: AllocatedSide) -> None:
        """Work in these pools from now on (the caller failed what was live)."""
        self._adopt(spec, layout)
        self._hold(spec, layout, pools)

    def refuse_pools(self, detail: str) -> None:
        """No memory from now on: every path that would touch it refuses, saying why."""
        self._hold(None, None, None, f"no engine attached ({detail})")


C = TypeVar("C", bound=CoreBase)


def named(call: Callable[[], T], after: Callable[..., object]) -> Callable[[], T]:
    """``call``, named as ``after`` (its qualified name): what the loop's stall warning
    says of a call handed to it (the event it carries, not the wrapper)."""
    call.__qualname__ = getattr(after, "__qualname__", call.__qualname__)
    return call


class DriverBase(ABC, Generic[C]):
    """What both drivers show of their core (``core``), and how either takes up or
    gives up an engine's memory (failing what is live first: its peers are told)."""

    core: C
    #: The daemon's loop, the one thread that calls the core once it serves (None: the
    #: caller's thread, as a unit test's driver without a loop).
    loop: DaemonLoop | None = None

    def on_loop(self, call: Callable[[], T]) -> T:
        """Run ``call`` (which calls the core) on the daemon's loop and return what it
        returned: at once on the loop's thread, or where no loop serves; from any other
        thread (a gRPC handler, an executor job) handed to the loop and waited for.
        The caller holds no lock."""
        loop = self.loop
        if loop is not None and loop.stopped:
            # Shutdown's stragglers (an executor job finishing, the last end-log lines)
            # after the loop stopped: one at a time, as on the loop.
            with _AFTER_LOOP:
                return call()
        if loop is None or loop.on_loop or not loop.running:
            return call()
        return loop.run_sync(call, timeout_s=LOOP_CALL_TIMEOUT_S)

    @property
    def _off_loop(self) -> bool:
        """Whether a loop serves (or served: it stopped) and this thread is not it: a call
        into the core is handed over (:meth:`on_loop`)."""
        loop = self.loop
        return loop is not None and (loop.running or loop.stopped) and not loop.on_loop

    @property
    def on_loop_thread(self) -> bool:
        """Whether the caller is the daemon's loop (where nothing may wait for the
        transport: its completions come through the loop)."""
        return self.loop is not None and self.loop.on_loop

    @abstractmethod
    def shutdown(self, detail: str) -> None:
        """Fail every live request, tell the peer side of each (bounded), release links."""

    def use_pools(self, spec: PoolSpec, layout: SideLayout, pools: AllocatedSide) -> None:
        """Work in these pools from now on: the daemon's own (at start) or an attached
        engine's (a request that raced the detach is failed first: its pages are
        stale)."""
        if self.core.table.live_count():
            self.shutdown("engine memory replaced while the request was being accepted")
        self.on_loop(lambda: self.core.take_pools(spec, layout, pools))

    def drop_pools(self, detail: str) -> None:
        """The engine's memory goes: refuse new requests, fail every live one (the peer
        side is told, bounded), release every link (their writes stop)."""
        self.on_loop(lambda: self.core.refuse_pools(detail))
        self.shutdown(detail)

    @property
    def table(self) -> TransferTable:
        """The lifecycle states (the core's)."""
        return self.core.table

    @property
    def peers(self) -> Peers:
        """The verified peers and the connections to them."""
        return self.core.peers

    @property
    def spec(self) -> PoolSpec:
        """The target pool's spec (NoEngineAttached while there is none)."""
        return self.core.spec

    @property
    def layout(self) -> SideLayout:
        """The side's layout."""
        return self.core.layout

    @property
    def pools(self) -> AllocatedSide:
        """The memory."""
        return self.core.pools

    def status(self, request_id: str) -> TransferStatus:
        """The request's status."""
        return self.core.status(request_id)

    def facts_of(self, request_id: str) -> TransferFacts:
        """What the request moves (:meth:`CoreBase.facts_of`), for status replies."""
        return self.on_loop(lambda: self.core.facts_of(request_id))

    @abstractmethod
    def slot_of(self, request_id: str) -> int:
        """The request slot it uses, -1 if none."""

    def reply_view(self, request_id: str) -> tuple[int, TransferFacts]:
        """Its slot and what it moves, for a status reply: one call on the loop (a
        handler's reply otherwise hands two to it)."""
        return self.on_loop(lambda: (self.slot_of(request_id),
                                     self.core.facts_of(request_id)))
