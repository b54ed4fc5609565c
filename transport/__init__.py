"""Data plane: moves bytes between (address, length, key) regions.

This package never imports torch: daemons that only route control messages, and
tests running under TCG (where ``import torch`` costs about a minute), must not
pay for it. pyverbs is imported only when the verbs transport is opened, so the
package imports where rdma-core is absent.

Usage (both sides)::

    t = open_transport("auto")
    reg = t.register([Region(addr, nbytes)], Access.REMOTE_WRITE)  # decode; LOCAL on prefill
    link = t.create_link()                  # link.endpoint -> handshake -> peer_endpoint
    link.connect(peer_endpoint)
    link.write(transfer_id, blocks)         # prefill
    for ev in t.events(timeout=1.0): ...    # COMPLETED (prefill) / NOTIFIED (decode)
    t.close()
"""

from kvbeam.transport.base import Access, Event, EventKind, Link, Registration, Transport
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.endpoint import Endpoint, Region, RemoteRegion
from kvbeam.transport.factory import open_transport, pick_rdma_device, rdma_devices
from kvbeam.transport.options import TransportOptions

__all__ = [
    "Access",
    "Blocks",
    "Endpoint",
    "Event",
    "EventKind",
    "Link",
    "Region",
    "Registration",
    "RemoteRegion",
    "Transport",
    "TransportOptions",
    "open_transport",
    "pick_rdma_device",
    "rdma_devices",
]
