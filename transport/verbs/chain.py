"""Send WRs built with numpy, a whole transfer at once, and posted as chains.

:func:`build` turns a checked transfer into a :class:`WrBatch`: one descriptor per WR
(:data:`DESC_DTYPE`: wr_id, remote address and key, source address, length and key,
opcode, flags, immediate), the RDMA WRITE WITH IMM marker last and the signalled WRs
chosen, all checked (:func:`check_descriptors`) before anything can be posted. The
loop thread then posts any slice ``[a, b)`` of it with :meth:`Poster.post`. The
provider copies WRs into its queue during ``ibv_post_send``, so nothing has to stay
alive after the call.

Two posters behind one method (:class:`Poster`; ``TransportOptions.poster``):

- compiled (default where it was built): ``kvbeam.transport.verbs._post``
  (transport/verbs/_post.c, built at install) builds the ``ibv_send_wr``/``ibv_sge``
  chain of the slice from the descriptors in C, with ``<infiniband/verbs.h>``'s own
  structs, and calls ``ibv_post_send`` once, the GIL released: no Python per WR. It
  takes the QP's ``struct ibv_qp`` pointer from the pyverbs QP object as pyverbs' own
  qp.pxd declares it, after checking the object's type, size and neighbouring fields and
  that the verbs QP has the object's qp_num and PD (pyverbs 44 has no accessor for it;
  _post.c says why this is safe); it writes nothing into pyverbs' objects.
- pyverbs (fallback, or forced): one pyverbs SendWR object per WR, built from the
  descriptors at each post and posted as one chain through ``QP.post_send``. Used where
  the helper was not built, does not load, or does not recognise pyverbs' QP layout.
"""

from __future__ import annotations

import importlib
import logging
import socket
import weakref
from types import ModuleType
from typing import Any

import numpy as np

from kvbeam.errors import TransportError
from kvbeam.transport.core import Prepared
from kvbeam.transport.options import MAX_CHAIN, POSTER_KINDS

log = logging.getLogger(__name__)

#: One WR as both posters read it (struct kvbeam_wr_desc in _post.c, checked at load).
DESC_DTYPE = np.dtype({
    "names": ["wr_id", "remote_addr", "addr", "length", "lkey", "rkey", "imm_data", "opcode",
              "send_flags", "num_sge"],
    "formats": [np.uint64, np.uint64, np.uint64, np.uint32, np.uint32, np.uint32, np.uint32,
                np.uint8, np.uint8, np.uint8],
    "offsets": [0, 8, 16, 24, 28, 32, 36, 40, 41, 42],
    "itemsize": 48,
})

WR_RDMA_WRITE = 0  # enum ibv_wr_opcode
WR_RDMA_WRITE_WITH_IMM = 1
SEND_SIGNALED = 2  # enum ibv_send_flags
#: The longest WR verbs allow (ibv_port_attr.max_msg_sz is at most 2**31).
MAX_WR_BYTES = 1 << 31
#: The most WRs one transfer's batch may hold (wr_ids keep the position in 32 bits).
MAX_BATCH_WRS = 1 << 32


def id_to_imm(transfer_id: int) -> int:
    """The immediate value that carries ``transfer_id`` (network byte order on the wire)."""
    return socket.htonl(transfer_id)


def imm_to_id(imm_data: int) -> int:
    """The transfer id in a completion's immediate: :func:`id_to_imm` undone."""
    return socket.ntohl(imm_data)


class WrBatch:
    """One transfer's WRs: ``n`` checked descriptors (:data:`DESC_DTYPE`) and its signals.

    ``signals[i]`` is ``(wr_id, WRs it retires, tag if it is the batch's last WR else
    None)`` for the signalled WR at position ``signal_pos[i]``; the tag is the transfer
    id unless :func:`build` was given another.
    """

    __slots__ = ("descs", "n", "signal_pos", "signals")

    def __init__(self, descs: np.ndarray[Any, np.dtype[np.void]], signal_pos: list[int],
                 signals: list[tuple[int, int, object]]) -> None:
        self.descs = descs
        self.n = len(descs)
        self.signal_pos = signal_pos
        self.signals = signals


def build(p: Prepared, serial: int, signal_every: int, marker: tuple[int, int],
          tag: object = None) -> WrBatch:
    """The WRs of a transfer: one RDMA WRITE per block, then (with ``notify``) the marker.

    The marker is a zero-length RDMA WRITE WITH IMM whose immediate is the transfer
    id in network order; ``marker`` is a valid remote (addr, rkey) for it. One WR
    in ``signal_every`` is signalled, and always the last, so a transfer never
    leaves unsignalled WRs behind. wr_ids are ``serial << 32 | position``. The last
    signal carries ``tag`` (default: the transfer id). The descriptors are checked
    (:func:`check_descriptors`): a bad one raises here, before anything is posted.
    """
    n_data = len(p)
    n = n_data + (1 if p.notify else 0)
    if n > MAX_BATCH_WRS:
        raise TransportError(f"a transfer of {n} WRs does not fit one batch (at most "
                             f"{MAX_BATCH_WRS}); nothing was posted")
    descs = np.zeros(n, DESC_DTYPE)
    descs["num_sge"][:n_data] = 1
    descs["remote_addr"][:n_data] = p.dst
    descs["rkey"][:n_data] = p.rkeys
    descs["addr"][:n_data] = p.src
    descs["length"][:n_data] = check_lengths(p.lengths)
    descs["lkey"][:n_data] = p.lkeys
    if p.notify:
        descs["opcode"][n_data] = WR_RDMA_WRITE_WITH_IMM
        descs["imm_data"][n_data] = id_to_imm(p.transfer_id)
        descs["remote_addr"][n_data], descs["rkey"][n_data] = marker
    if n == 0:
        return WrBatch(descs, [], [])
    pos = np.arange(signal_every - 1, n, signal_every, dtype=np.int64)
    if not len(pos) or pos[-1] != n - 1:
        pos = np.concatenate((pos, [n - 1]))
    wr_ids = (np.uint64(serial) << np.uint64(32)) | pos.astype(np.uint64)
    descs["send_flags"][pos] = SEND_SIGNALED
    descs["wr_id"][pos] = wr_ids
    check_descriptors(descs)
    retired = pos + 1  # WRs each signalled WR retires: back to the previous one
    retired[1:] -= pos[:-1] + 1
    finals: list[object] = [None] * (len(pos) - 1) + [p.transfer_id if tag is None else tag]
    signals = list(zip(wr_ids.tolist(), retired.tolist(), finals, strict=True))
    return WrBatch(descs, pos.tolist(), signals)


def check_lengths(lengths: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, Any]:
    """``lengths`` if each is in (0, MAX_WR_BYTES] (one WR each); TransportError otherwise."""
    bad = np.flatnonzero((lengths == 0) | (lengths > MAX_WR_BYTES))
    if len(bad):
        i = int(bad[0])
        raise TransportError(f"block {i} of the write is {int(lengths[i])} bytes: a WR moves 1 "
                             f"to {MAX_WR_BYTES} bytes; nothing was posted")
    return lengths


def check_descriptors(descs: np.ndarray[Any, np.dtype[np.void]]) -> None:
    """Refuse (TransportError) a batch with any WR neither poster may post.

    Every WR is an RDMA WRITE of one SGE of 1 to MAX_WR_BYTES bytes from a nonzero
    address, or a zero-length WRITE WITH IMM with no SGE; its flags are at most
    SIGNALED; the last WR is signalled. Addresses and keys were checked against the
    registered regions by :func:`kvbeam.transport.core.prepare`.
    """
    if descs.dtype != DESC_DTYPE or descs.ndim != 1:
        raise TransportError(f"WR descriptors of dtype {descs.dtype} and shape {descs.shape}: "
                             "not kvbeam's; nothing was posted")
    op, flags, sges, length = (descs[k] for k in ("opcode", "send_flags", "num_sge", "length"))
    write = (op == WR_RDMA_WRITE) & (sges == 1) & (length > 0) & (length <= MAX_WR_BYTES) & (
        descs["addr"] > 0)
    marker = (op == WR_RDMA_WRITE_WITH_IMM) & (sges == 0) & (length == 0)
    bad = np.flatnonzero(~(write | marker) | ((flags & ~np.uint8(SEND_SIGNALED)) != 0))
    if len(bad):
        i = int(bad[0])
        raise TransportError(
            f"WR {i} of {len(descs)}: opcode {int(op[i])}, {int(sges[i])} SGE(s) of "
            f"{int(length[i])} bytes at {int(descs['addr'][i]):#x}, flags {int(flags[i])}: not "
            "an RDMA WRITE kvbeam posts; nothing was posted")
    if len(descs) and not int(flags[-1]) & SEND_SIGNALED:
        raise TransportError(f"the last of {len(descs)} WRs is not signalled: its completion "
                             "would never be seen; nothing was posted")


_helper: ModuleType | bool | None = False  # False: not loaded yet; None: not available
_helper_why = ""


def compiled_helper() -> tuple[ModuleType | None, str]:
    """The compiled poster module, or None and why not (tried once per process)."""
    global _helper, _helper_why
    if _helper is False:
        try:
            module = importlib.import_module("kvbeam.transport.verbs._post")
            layout = {name: spec[1] for name, spec in (DESC_DTYPE.fields or {}).items()}
            consts = (module.WR_RDMA_WRITE, module.WR_RDMA_WRITE_WITH_IMM, module.SEND_SIGNALED,
                      module.MAX_CHAIN)
            if (module.DESC_SIZE, module.DESC_OFFSETS, consts) != (
                    DESC_DTYPE.itemsize, layout,
                    (WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, SEND_SIGNALED, MAX_CHAIN)):
                raise ImportError(f"its descriptor layout {module.DESC_OFFSETS} "
                                  f"({module.DESC_SIZE} bytes) or constants {consts} differ "
                                  "from chain.py's (a stale build: rebuild it)")
            _helper = module
        except (ImportError, AttributeError) as exc:  # not built, or not this layout
            _helper, _helper_why = None, f"{type(exc).__name__}: {exc}"
    return (_helper if isinstance(_helper, ModuleType) else None), _helper_why


class Poster:
    """Posts a slice of a :class:`WrBatch` as one chain: compiled, or pyverbs objects.

    ``kind`` "auto" takes the compiled helper when it loads and falls back to pyverbs
    objects (saying why, once: :attr:`why`); "compiled" raises TransportError where it
    cannot be used; "pyverbs" never tries it. A QP whose pyverbs layout the helper does
    not recognise (checked once per QP) is posted to through pyverbs objects under
    "auto" and refused under "compiled".
    """

    def __init__(self, kind: str = "auto") -> None:
        if kind not in POSTER_KINDS:
            raise ValueError(f"poster must be one of {', '.join(POSTER_KINDS)}, got {kind!r}")
        from pyverbs.wr import SGE, SendWR  # noqa: F401  (the fallback must import)

        self.requested = kind
        helper, why = compiled_helper() if kind != "pyverbs" else (None, "forced by poster=pyverbs")
        if kind == "compiled" and helper is None:
            raise TransportError(f"the compiled WR poster was requested but cannot be loaded: "
                                 f"{why}; rebuild it (docs/troubleshooting.md)")
        self._helper = helper
        #: Why the compiled poster is not in use ("" when it is).
        self.why = "" if helper is not None else why
        self._checked: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    @property
    def kind(self) -> str:
        """The poster in use: "compiled" or "pyverbs"."""
        return "compiled" if self._helper is not None else "pyverbs"

    def post(self, qp: Any, batch: WrBatch, a: int, b: int) -> None:
        """``ibv_post_send`` WRs ``a`` to ``b - 1`` of the batch as one chain."""
        helper = self._helper
        if helper is not None and self._compiled_ok(helper, qp):
            helper.post(qp, batch.descs, a, b)
        else:
            self._post_objects(qp, batch, a, b)

    def _compiled_ok(self, helper: ModuleType, qp: Any) -> bool:
        ok = self._checked.get(qp)
        if ok is None:
            try:
                helper.qp_ready(qp)
                ok = True
            except (TypeError, ValueError) as exc:
                if self.requested == "compiled":
                    raise TransportError(f"the compiled WR poster cannot post to this QP: "
                                         f"{exc}") from exc
                log.warning("the compiled WR poster does not recognise this QP (%s): posting "
                            "to it through pyverbs objects (slower)", exc)
                ok = False
            self._checked[qp] = ok
        return ok

    @staticmethod
    def _post_objects(qp: Any, batch: WrBatch, a: int, b: int) -> None:
        # Fresh objects per post: pyverbs 44 can neither read an SGE pointer back nor
        # unlink a WR, so reusing objects is not possible through its API.
        from pyverbs.wr import SGE, SendWR

        if not 0 <= a < b <= batch.n:
            raise TransportError(f"WRs [{a}, {b}) of a batch of {batch.n}: not a slice; nothing "
                                 "was posted")
        chain: list[Any] = []
        nxt: Any = None
        for row in reversed(batch.descs[a:b].tolist()):
            wr_id, raddr, addr, length, lkey, rkey, imm, opcode, flags, num_sge = row
            wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(addr, length, lkey)],
                        send_flags=flags, imm_data=imm, next_wr=nxt)
            wr.num_sge = num_sge
            wr.set_wr_rdma(rkey, raddr)
            chain.append(wr)
            nxt = wr
        qp.post_send(nxt)
