"""What both cores share: their pools (an engine's, on ``--pools engine``) and status.

:class:`CoreBase` is the base of :class:`~kvbeam.server.core.prefill.PrefillCore`
and :class:`~kvbeam.server.core.decode.DecodeCore`: one place for the status
accessor and for taking up or refusing an engine's memory. Failing what was live
first is the caller's (each role's driver): it is I/O (peers are told).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TypeVar

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.sub_batches import buffer_bytes
from kvbeam.server.core.attached import PoolsHolder
from kvbeam.server.core.ports import IndexLists, require_status
from kvbeam.server.lifecycle import TransferTable
from kvbeam.states import TransferStatus

R = TypeVar("R")


def request_bytes(layout: SideLayout, indices: IndexLists, draft: IndexLists) -> int:
    """The bytes a whole request moves: every buffer's items of its list (the draft's own
    list for a draft buffer that has one)."""
    return sum(buffer_bytes(layout, indices, draft))


class CoreBase(PoolsHolder):
    """The status accessor and the engine-pools switch of a core (state is the core's)."""

    table: TransferTable
    #: "prefill" or "decode", for the UnknownRequest message.
    role: str = ""
    _lock: threading.Lock

    def status(self, request_id: str) -> TransferStatus:
        """The request's status."""
        return require_status(self.table, request_id, self.role)

    def _lookup(self, records: Mapping[str, R], request_id: str) -> R | None:
        """The core's record of a request (``records`` is its map), None once forgotten."""
        with self._lock:
            return records.get(request_id)

    def _adopt(self, spec: PoolSpec, layout: SideLayout) -> None:
        """Size the core's own state for an engine's config (decode: its slots)."""

    def take_pools(self, spec: PoolSpec, layout: SideLayout, pools: AllocatedSide) -> None:
        """Work in an engine's memory from now on (the caller failed what was live)."""
        self._adopt(spec, layout)
        self._hold(spec, layout, pools)

    def refuse_pools(self, detail: str) -> None:
        """No memory from now on: every path that would touch it refuses, saying why."""
        self._hold(None, None, None, f"no engine attached ({detail})")
