"""What an RDMA link needs from its transport, and its posting counters."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from kvbeam.transport.host import LinkHost
from kvbeam.transport.verbs.device import VerbsDevice
from kvbeam.transport.verbs.qp import QueuePair


class VerbsHost(LinkHost, Protocol):
    """What an RDMA link needs from its transport beyond :class:`LinkHost`."""

    @property
    def device(self) -> VerbsDevice:
        """The opened device: GID, MTU and name go into the link's endpoint."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The transport lock (re-entrant). The loop holds it while it
        services links; a link takes it to change its QP's state (connect, release)."""

    def posted(self, wrs: int) -> None:
        """Count work requests posted."""

    def wake(self) -> None:
        """Wake the transport's loop: there is work to post (never blocks)."""

    def bind(self, link_id: int, qps: Sequence[QueuePair]) -> None:
        """Bind link ``link_id``'s memory windows through its QPs, just connected (the
        caller holds the transport lock); raises TransportError if they cannot be."""

    def revoke(self, link_id: int) -> None:
        """Revoke link ``link_id``'s own memory keys (deallocate its memory windows), at
        once; called under the transport lock just before its QPs are destroyed."""


@dataclass
class LinkStats:
    """Counters of one link's posting work (for benchmarks and metrics)."""

    wrs: int = 0  # WRs posted, markers included
    posts: int = 0  # ibv_post_send calls
    post_s: float = 0.0  # wall time inside ibv_post_send (with rxe: the kernel sends from it)
    book_s: float = 0.0  # progress-thread CPU time around the posts
    prepare_s: float = 0.0  # CPU time in write(): slicing, bounds checks, keys, WR arrays
