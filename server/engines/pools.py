"""What the runtime keeps of its pools (own or attached), and the engine attach gauges.

:class:`Pools` is one set of usable pools: config, layout, memory and its
registration; the runtime holds one (``--pools own``: from start to stop) or none
(``--pools engine`` before an attach and after a detach). :func:`release` tears one
down in the one safe order: deregister (waits for in-flight writes), then unmap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.shared import MappedSide
from kvbeam.pools.shm import unmap
from kvbeam.pools.spec import PoolSpec, SideConfig
from kvbeam.transport.base import Registration

log = logging.getLogger(__name__)

#: The layout an engine daemon advertises before any attach. Never sent to a peer
#: (handshakes are refused until an engine attaches); it only lets the control
#: server start. Pure data: nothing is allocated.
UNATTACHED_LAYOUT: SideLayout = build_side_layout(
    SideConfig(model="unattached", target=PoolSpec((0,), num_req_slots=1)))


@dataclass(frozen=True)
class Pools:
    """Usable pools: what they hold, where they are, their registration."""

    config: SideConfig
    layout: SideLayout
    side: AllocatedSide
    registration: Registration


def release(pools: Pools) -> int:
    """Deregister (waiting for writes that use the memory), then unmap attached memory.

    Returns the mappings still referenced (0: everything unmapped). The caller must
    have dropped every other reference to ``pools.side`` (cores, runtime).
    """
    pools.registration.release()
    if not isinstance(pools.side, MappedSide):
        return 0
    maps = pools.side.take_maps()
    return unmap(maps)


class AttachGauges:
    """``kvbeam_engine_attached`` and ``kvbeam_engine_registered_regions``/``_bytes``:
    what the daemon holds of an engine's memory (all 0 once it detached)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.attached = Gauge("kvbeam_engine_attached",
                              "1 while an engine's memory is attached (--pools engine)",
                              registry=registry)
        self.regions = Gauge("kvbeam_engine_registered_regions",
                             "Regions (MRs on RDMA) registered over attached engine memory",
                             registry=registry)
        self.mapped = Gauge("kvbeam_engine_mapped_bytes",
                            "Bytes of engine memory mapped into the daemon", registry=registry)

    def on_attach(self, pools: Pools) -> None:
        """An engine's memory is mapped and registered."""
        self.attached.set(1)
        self.regions.set(len(pools.registration.regions))
        self.mapped.set(sum(r.length for r in pools.registration.regions))

    def on_detach(self) -> None:
        """The memory is deregistered and unmapped."""
        self.attached.set(0)
        self.regions.set(0)
        self.mapped.set(0)
