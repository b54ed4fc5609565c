"""The pools a core works on, given after it is built: the daemon's own as it starts
(``--pools own``), an engine's when it attaches (``--pools engine``).

:class:`PoolsHolder` gives a core ``spec``, ``layout`` and ``pools`` attributes that
raise :class:`~kvbeam.errors.NoEngineAttached` while there are none (``--pools
engine`` before an attach, or after a detach), so every path that would touch
memory refuses cleanly instead of reading a stale mapping. The servicers refuse
Reserve and Send before they reach a core; this is the second line.
"""

from __future__ import annotations

from kvbeam.errors import NoEngineAttached
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.spec import PoolSpec

NO_POOLS = "no engine attached: this daemon has no pools yet"


class PoolsHolder:
    """``spec``/``layout``/``pools`` of a core; see the module docstring."""

    _held: tuple[PoolSpec, SideLayout, AllocatedSide] | None = None
    _missing: str = NO_POOLS

    def _hold(self, spec: PoolSpec | None, layout: SideLayout | None,
              pools: AllocatedSide | None, missing: str = NO_POOLS) -> None:
        """Hold these pools (all three given), or none (``missing`` says why)."""
        if spec is not None and layout is not None and pools is not None:
            self._held = (spec, layout, pools)
        else:
            self._held = None
        self._missing = missing

    def _require_pools(self) -> tuple[PoolSpec, SideLayout, AllocatedSide]:
        held = self._held
        if held is None:
            raise NoEngineAttached(self._missing)
        return held

    # The properties read ``_held`` themselves and call the helper only to raise: a
    # request reads them several times.
    @property
    def spec(self) -> PoolSpec:
        """The target pool's spec."""
        held = self._held
        return held[0] if held is not None else self._require_pools()[0]

    @property
    def layout(self) -> SideLayout:
        """The side's layout (buffers at the memory's own offsets)."""
        held = self._held
        return held[1] if held is not None else self._require_pools()[1]

    @property
    def pools(self) -> AllocatedSide:
        """The memory."""
        held = self._held
        return held[2] if held is not None else self._require_pools()[2]
