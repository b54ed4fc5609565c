"""What one side tells its peer about its data plane in the handshake.

These are plain values (no verbs objects) so the control plane can carry them in
protobuf and tests can build them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Region:
    """A local memory region: ``length`` bytes starting at virtual address ``addr``."""

    addr: int
    length: int

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.addr + self.length


@dataclass(frozen=True)
class DmaBufRegion:
    """``length`` bytes at ``offset`` of dma-buf ``fd`` (device memory, e.g. a GPU's),
    addressed from ``iova``: the address work requests and peers use for its first byte
    (an address range the daemon reserved, so it collides with no other region)."""

    fd: int
    offset: int
    length: int
    iova: int

    @property
    def region(self) -> Region:
        """The region it is addressed as."""
        return Region(self.iova, self.length)


@dataclass(frozen=True)
class RemoteRegion:
    """A region of the peer's memory the peer allows us to write: address, length and rkey."""

    addr: int
    length: int
    rkey: int = 0

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.addr + self.length


@dataclass(frozen=True)
class Endpoint:
    """A side's data-plane endpoint for one peer connection.

    ``kind`` is ``"rdma"`` or ``"tcp"``. For RDMA, ``gid``/``qpns``/``psn``/``mtu``
    describe the RC queue pair(s) created for this peer (one QPN per QP) and
    ``regions`` the registered buffers with their rkeys, positionally aligned with
    the pool layout's flat buffer list. For TCP, ``address`` is ``host:port`` and
    rkeys are 0.
    """

    kind: str
    regions: tuple[RemoteRegion, ...] = ()
    gid: str = ""
    qpns: tuple[int, ...] = ()
    psn: int = 0
    mtu: int = 0
    address: str = ""
    extra: dict[str, str] = field(default_factory=dict)
