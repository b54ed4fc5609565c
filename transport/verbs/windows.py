"""Memory windows: per-link remote-write keys over memory registered once.

A decode pool is registered once, with local access and the right to bind memory
windows (``IBV_ACCESS_MW_BIND``) but no remote access of its own. Each link gets one
window per remote-writable region: allocating it is constant work, whatever the
region's size, and its rkey is known before the bind (the bind gives the window the
next key of its own index, ``ibv_inc_rkey``), so the handshake can carry it. The bind
is a work request on the link's QP, posted once the QP is connected and completed
before the handshake reply leaves. Deallocating the window revokes the key.

Type 2 windows (used with one QP per link) are bound to that QP: the key works only
for writes arriving on it, so a peer that learned another peer's key still cannot use
it. With several QPs per link the endpoint carries one key per region for all of them,
so the windows are type 1 (valid on any QP of the protection domain, like a per-link
memory region; revoked the same way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvbeam.errors import TransportError
from kvbeam.transport import status as st
from kvbeam.transport.verbs.device import VerbsDevice

log = logging.getLogger(__name__)

BIND_TAG = 1 << 62  # wr_id bit of bind WRs (never set on writes or receives)
_POLL_SLEEP_S = 1e-4


class Window:
    """One memory window over ``[addr, addr + length)`` of ``mr``, for one link."""

    __slots__ = ("_info", "_wr", "mw", "mw_type", "rkey")

    def __init__(self, dev: VerbsDevice, mr: Any, addr: int, length: int, mw_type: int) -> None:
        import pyverbs.enums as e
        from pyverbs.mr import MW, MWBindInfo
        from pyverbs.wr import SendWR, inc_rkey

        self.mw_type = mw_type
        try:
            self.mw: Any = MW(dev.pd, e.IBV_MW_TYPE_2 if mw_type == 2 else e.IBV_MW_TYPE_1)
        except Exception as exc:
            raise TransportError(f"cannot allocate a memory window on {dev.name} (max_mw "
                                 f"{dev.max_mw}): {exc}") from exc
        try:
            # Remote write only: a window never grants remote read or atomics.
            self._info = MWBindInfo(mr, addr, length, e.IBV_ACCESS_REMOTE_WRITE)
            self._wr: Any = None
            if mw_type == 2:
                self._wr = SendWR(opcode=e.IBV_WR_BIND_MW, send_flags=0)
                self._wr.set_bind_wr(self.mw, self._info)
                self.rkey = int(self._wr.rkey)
            else:
                self.rkey = int(inc_rkey(self.mw.rkey))
        except Exception as exc:
            self.mw.close()
            raise TransportError(f"cannot prepare a memory window over {length} bytes at "
                                 f"{addr:#x}: {exc}") from exc

    def close(self) -> None:
        """Deallocate the window: its key stops working at once."""
        self.mw.close()


def bind_windows(qp: Any, windows: Sequence[Window], timeout: float) -> None:
    """Bind ``windows`` through ``qp`` (a connected :class:`QueuePair`) and wait until
    every bind completed; raises TransportError naming the status otherwise.

    The caller holds the transport lock (the loop does not poll this QP
    meanwhile); binds are local work requests, no registration.
    """
    import pyverbs.enums as e
    from pyverbs.mr import MWBind

    batch = max(1, qp.sq_depth - 1)
    for lo in range(0, len(windows), batch):
        part = windows[lo:lo + batch]
        try:
            for i, window in enumerate(part):
                tag = BIND_TAG | (lo + i)
                last = i == len(part) - 1
                if window.mw_type == 2:
                    wr = window._wr
                    wr.wr_id = tag
                    wr.send_flags = e.IBV_SEND_SIGNALED if last else 0
                    qp.qp.post_send(wr)
                else:  # ibv_bind_mw: always signalled
                    qp.qp.bind_mw(window.mw, MWBind(window._info, e.IBV_SEND_SIGNALED, tag))
        except Exception as exc:
            raise TransportError(f"cannot bind memory windows on QP {qp.qpn}: {exc}",
                                 st.POST_SEND_FAILED) from exc
        signalled = {BIND_TAG | (lo + i) for i, w in enumerate(part)
                     if w.mw_type == 1 or i == len(part) - 1}
        _wait(qp, signalled, timeout)
        for window in part:
            if window.mw_type == 1 and int(window.mw.rkey) != window.rkey:
                raise TransportError(f"memory window bound with rkey {int(window.mw.rkey):#x}, "
                                     f"expected {window.rkey:#x}")


def _wait(qp: Any, tags: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while tags:
        for wc in qp.poll(16):
            wr_id = int(wc.wr_id)
            if wc.status != 0:
                raise TransportError(
                    f"binding a memory window on QP {qp.qpn} failed: "
                    f"{st.wc_status_name(int(wc.status))} (vendor_err {wc.vendor_err})",
                    st.wc_status_name(int(wc.status)))
            if not wr_id & BIND_TAG:
                raise TransportError(f"QP {qp.qpn}: completion {wr_id:#x} before its memory "
                                     "windows were bound")
            tags.discard(wr_id)
        if tags:
            if time.monotonic() > deadline:
                raise TransportError(f"memory windows on QP {qp.qpn} not bound within "
                                     f"{timeout:g} s", st.TIMEOUT)
            time.sleep(_POLL_SLEEP_S)
