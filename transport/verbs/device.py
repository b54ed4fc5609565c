"""Verbs resources of one device: the context and protection domain, and memory regions.

Each class owns the lifetimes of what it creates and closes them in reverse
order (the pattern of rdma-core's pyverbs tests/base.py).
"""

from __future__ import annotations

import logging
from typing import Any

from kvbeam.errors import TransportError
from kvbeam.transport.base import Access

log = logging.getLogger(__name__)

PORT = 1  # rxe and single-port NICs; multi-port HCAs show one device per port in practice


def mtu_bytes(mtu_enum: int) -> int:
    """``enum ibv_mtu`` (1 = 256 ... 5 = 4096) to bytes."""
    return 128 << mtu_enum


def mtu_enum(nbytes: int) -> int:
    """Bytes (256 ... 4096) to ``enum ibv_mtu``."""
    return max(1, min(5, nbytes.bit_length() - 8))


class VerbsDevice:
    """Context + PD on ``name``, port 1, GID ``gid_index``; the port's MTU and limits."""

    def __init__(self, name: str, gid_index: int) -> None:
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.name = name
        self.gid_index = gid_index
        try:
            self.ctx: Any = Context(name=name)
        except Exception as exc:
            raise TransportError(f"cannot open RDMA device {name!r}: {exc}") from exc
        try:
            self.pd: Any = PD(self.ctx)
            port = self.ctx.query_port(PORT)
            self.mtu = int(port.active_mtu)
            self.gid = str(self.ctx.query_gid(PORT, gid_index))
            attr = self.ctx.query_device()
            self.max_qp_wr = int(attr.max_qp_wr)
            self.max_cqe = int(attr.max_cqe)
            self.max_mw = int(attr.max_mw)
            self.cap_flags = int(attr.device_cap_flags)
        except Exception as exc:
            self.ctx.close()
            raise TransportError(f"cannot use RDMA device {name!r} port {PORT} GID index "
                                 f"{gid_index}: {exc}") from exc
        if self.gid.replace("0", "").replace(":", "") == "":
            self.close()
            raise TransportError(f"RDMA device {name!r} has no GID at index {gid_index} "
                                 "(set KVBEAM_RDMA_GID_INDEX)")
        log.info("RDMA device %s: GID[%d]=%s, active MTU %d", name, gid_index, self.gid,
                 mtu_bytes(self.mtu))

    def window_type(self, qps_per_link: int) -> int | None:
        """The memory window type links use (see :mod:`kvbeam.transport.verbs.windows`):
        2 (bound to the link's one QP), 1 (several QPs per link), None: no windows here."""
        import pyverbs.enums as e

        if self.max_mw <= 0 or not self.cap_flags & e.IBV_DEVICE_MEM_WINDOW:
            return None
        type2 = e.IBV_DEVICE_MEM_WINDOW_TYPE_2A | e.IBV_DEVICE_MEM_WINDOW_TYPE_2B
        return 2 if qps_per_link == 1 and self.cap_flags & type2 else 1

    def register(self, addr: int, length: int, access: Access, *, windows: bool = False) -> Any:
        """An MR over ``[addr, addr + length)``: local only, or remote write (never read).

        ``windows``: memory windows may be bound over it (it grants no remote access
        itself; each window grants remote write through its own key).
        """
        import pyverbs.enums as e
        from pyverbs.mr import MR

        flags = e.IBV_ACCESS_LOCAL_WRITE
        if access is Access.REMOTE_WRITE:
            flags |= e.IBV_ACCESS_REMOTE_WRITE
        if windows:
            flags |= e.IBV_ACCESS_MW_BIND
        try:
            return MR(self.pd, length, flags, address=addr)
        except Exception as exc:
            raise TransportError(f"cannot register {length} bytes at {addr:#x} on "
                                 f"{self.name}: {exc} (is the memlock ulimit high enough?)"
                                 ) from exc

    def close(self) -> None:
        """Close the PD and context (MRs and QPs must be closed first)."""
        self.pd.close()
        self.ctx.close()
