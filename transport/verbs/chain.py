"""Send WRs built with numpy, a whole transfer at once, and posted as chains.

:func:`build` turns a checked transfer into a :class:`WrBatch`: C ``struct
ibv_send_wr``/``ibv_sge`` arrays (LP64 layout) already linked into one chain,
with the RDMA WRITE WITH IMM marker last and the signalled WRs chosen. The
progress thread then posts any slice ``[a, b)`` of it with :meth:`Poster.post`.
The provider copies WRs into its queue during ``ibv_post_send``, so nothing has
to stay alive after the call.

Two posters behind one method:

- raw (default): pyverbs hands ``ibv_post_send`` a pointer to the ``send_wr``
  struct inside a :class:`SendWR` object. We locate that struct once per process
  (verifying every field we use against values set through pyverbs), copy WR
  ``a`` into it, and let its ``next`` point into the numpy array: a chain of any
  length costs three memmoves and one ``post_send``, with no per-WR Python work.
- objects (fallback, or ``raw=False``): one SendWR object per WR, built from the
  arrays at each post. Used where the struct cannot be located.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
from typing import Any

import numpy as np

from kvbeam.transport.core import Prepared

log = logging.getLogger(__name__)

WR_DTYPE = np.dtype({
    "names": ["wr_id", "next", "sg_list", "num_sge", "opcode", "send_flags", "imm_data",
              "remote_addr", "rkey"],
    "formats": [np.uint64, np.uint64, np.uint64, np.int32, np.uint32, np.uint32, np.uint32,
                np.uint64, np.uint32],
    "offsets": [0, 8, 16, 24, 28, 32, 36, 40, 48],
    "itemsize": 128,  # sizeof(struct ibv_send_wr) on LP64
})
SGE_DTYPE = np.dtype({"names": ["addr", "length", "lkey"],
                      "formats": [np.uint64, np.uint32, np.uint32],
                      "offsets": [0, 8, 12], "itemsize": 16})

_struct_offset: int | bool | None = False  # False: not probed yet


def send_wr_struct_offset() -> int | None:
    """Offset of ``struct ibv_send_wr`` inside a pyverbs SendWR object, or None if unsure."""
    global _struct_offset
    if _struct_offset is False:
        try:
            _struct_offset = _probe_offset()
        except Exception:  # any surprise means: do not touch object memory
            log.exception("probing pyverbs SendWR layout failed")
            _struct_offset = None
        if _struct_offset is None:
            log.warning("pyverbs SendWR layout not recognised: posting WRs one object at a "
                        "time (slower)")
    return _struct_offset if isinstance(_struct_offset, int) else None


def _probe_offset() -> int | None:
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    a = SendWR(wr_id=0x5EED_0001_CAFE_F00D, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1,
               sg=[SGE(0x1234_5678, 4321, 0xABCD)], send_flags=e.IBV_SEND_SIGNALED,
               imm_data=0x0BADBEEF)
    b = SendWR(wr_id=2, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(1, 1, 1)], send_flags=0)
    a.next_wr = b
    a.set_wr_rdma(0x7E57_AB1E, 0x1122_3344_5566_7788)
    size = type(a).__basicsize__
    raw_a = ctypes.string_at(id(a), size)
    for off in range(0, size - WR_DTYPE.itemsize + 1, 8):
        wr = np.frombuffer(raw_a, WR_DTYPE, count=1, offset=off)[0]
        # pyverbs 44 cannot read back sg_list or the rdma fields: compare with what we
        # set, and dereference the sg_list candidate only once every other field matched.
        if (int(wr["wr_id"]) == 0x5EED_0001_CAFE_F00D and int(wr["next"]) == id(b) + off
                and int(wr["num_sge"]) == 1 and int(wr["opcode"]) == e.IBV_WR_RDMA_WRITE_WITH_IMM
                and int(wr["send_flags"]) == e.IBV_SEND_SIGNALED
                and int(wr["imm_data"]) == 0x0BADBEEF
                and int(wr["remote_addr"]) == 0x1122_3344_5566_7788
                and int(wr["rkey"]) == 0x7E57_AB1E and int(wr["sg_list"]) != 0
                and struct.unpack("<QII", ctypes.string_at(int(wr["sg_list"]), 16))
                == (0x1234_5678, 4321, 0xABCD)):
            return off
    return None


_WR_RDMA_WRITE_WITH_IMM = 1  # enum ibv_wr_opcode
_SEND_SIGNALED = 2  # enum ibv_send_flags


class WrBatch:
    """One transfer's WRs: ``n`` linked ibv_send_wr with their SGEs, and its signals.

    ``signals[i]`` is ``(wr_id, WRs it retires, tag if it is the batch's last WR else
    None)`` for the signalled WR at position ``signal_pos[i]``; the tag is the transfer
    id unless :func:`build` was given another.
    """

    __slots__ = ("n", "sge_addr", "sges", "signal_pos", "signals", "wr_addr", "wrs")

    def __init__(self, wrs: np.ndarray[Any, np.dtype[np.void]],
                 sges: np.ndarray[Any, np.dtype[np.void]], signal_pos: list[int],
                 signals: list[tuple[int, int, object]]) -> None:
        self.wrs, self.sges = wrs, sges
        self.n = len(wrs)
        self.wr_addr = int(wrs.ctypes.data)
        self.sge_addr = int(sges.ctypes.data)
        self.signal_pos = signal_pos
        self.signals = signals


def build(p: Prepared, serial: int, signal_every: int, marker: tuple[int, int],
          tag: object = None) -> WrBatch:
    """The WRs of a transfer: one RDMA WRITE per block, then (with ``notify``) the marker.

    The marker is a zero-length RDMA WRITE WITH IMM whose immediate is the transfer
    id in network order; ``marker`` is a valid remote (addr, rkey) for it. One WR
    in ``signal_every`` is signalled, and always the last, so a transfer never
    leaves unsignalled WRs behind. wr_ids are ``serial << 32 | position``. The last
    signal carries ``tag`` (default: the transfer id).
    """
    n_data = len(p)
    n = n_data + (1 if p.notify else 0)
    wrs = np.zeros(n, WR_DTYPE)
    sges = np.zeros(n, SGE_DTYPE)
    idx = np.arange(n, dtype=np.uint64)
    wrs["next"] = np.uint64(wrs.ctypes.data) + (idx + np.uint64(1)) * np.uint64(WR_DTYPE.itemsize)
    wrs["sg_list"] = np.uint64(sges.ctypes.data) + idx * np.uint64(SGE_DTYPE.itemsize)
    wrs["num_sge"][:n_data] = 1
    wrs["remote_addr"][:n_data] = p.dst
    wrs["rkey"][:n_data] = p.rkeys
    sges["addr"][:n_data] = p.src
    sges["length"][:n_data] = p.lengths
    sges["lkey"][:n_data] = p.lkeys
    if p.notify:
        wrs["opcode"][n_data] = _WR_RDMA_WRITE_WITH_IMM
        wrs["num_sge"][n_data] = 0
        wrs["imm_data"][n_data] = socket.htonl(p.transfer_id)
        wrs["remote_addr"][n_data], wrs["rkey"][n_data] = marker
    if n == 0:
        return WrBatch(wrs, sges, [], [])
    wrs["next"][n - 1] = 0
    pos = np.arange(signal_every - 1, n, signal_every, dtype=np.int64)
    if not len(pos) or pos[-1] != n - 1:
        pos = np.concatenate((pos, [n - 1]))
    wr_ids = (np.uint64(serial) << np.uint64(32)) | pos.astype(np.uint64)
    wrs["send_flags"][pos] = _SEND_SIGNALED
    wrs["wr_id"][pos] = wr_ids
    retired = pos + 1  # WRs each signalled WR retires: back to the previous one
    retired[1:] -= pos[:-1] + 1
    finals: list[object] = [None] * (len(pos) - 1) + [p.transfer_id if tag is None else tag]
    signals = list(zip(wr_ids.tolist(), retired.tolist(), finals, strict=True))
    return WrBatch(wrs, sges, pos.tolist(), signals)


class Poster:
    """Posts a slice of a :class:`WrBatch` as one chain (raw or through SendWR objects)."""

    def __init__(self, raw: bool | None = None) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        offset = send_wr_struct_offset() if raw is not False else None
        if raw and offset is None:
            raise RuntimeError("raw WR posting requested but the pyverbs layout is unknown")
        self.raw = offset is not None
        if offset is not None:
            self._head = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(0, 0, 0)],
                                send_flags=0)
            self._head_addr = id(self._head) + offset
            # The head's own sg_list pointer (pyverbs frees it): read it from the struct.
            self._head_sg = int(np.frombuffer(ctypes.string_at(self._head_addr, 128),
                                              WR_DTYPE, count=1)[0]["sg_list"])

    def post(self, qp: Any, batch: WrBatch, a: int, b: int) -> None:
        """``ibv_post_send`` WRs ``a`` to ``b - 1`` of the batch as one chain."""
        if not self.raw:
            self._post_objects(qp, batch, a, b)
            return
        nxt = batch.wrs["next"]
        saved = int(nxt[b - 1])
        nxt[b - 1] = 0
        try:
            wr = batch.wr_addr + a * WR_DTYPE.itemsize
            # Copy WR a into the head object but keep its own sg_list (pyverbs frees it).
            ctypes.memmove(self._head_addr, wr, 16)
            ctypes.memmove(self._head_addr + 24, wr + 24, WR_DTYPE.itemsize - 24)
            ctypes.memmove(self._head_sg, batch.sge_addr + a * SGE_DTYPE.itemsize,
                           SGE_DTYPE.itemsize)
            qp.post_send(self._head)
        finally:
            nxt[b - 1] = saved

    @staticmethod
    def _post_objects(qp: Any, batch: WrBatch, a: int, b: int) -> None:
        # Fresh objects per post: pyverbs 44 can neither read an SGE pointer back nor
        # unlink a WR, so reusing objects is not possible through its API.
        from pyverbs.wr import SGE, SendWR

        chain: list[Any] = []
        nxt: Any = None
        for row, sge in zip(reversed(batch.wrs[a:b].tolist()),
                            reversed(batch.sges[a:b].tolist()), strict=True):
            wr_id, _, _, num_sge, opcode, flags, imm, raddr, rkey = row
            wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(*sge)],
                        send_flags=flags, imm_data=imm, next_wr=nxt)
            wr.num_sge = num_sge
            wr.set_wr_rdma(rkey, raddr)
            chain.append(wr)
            nxt = wr
        qp.post_send(nxt)
