"""Memory regions over dma-buf fds (an engine's GPU memory), through the compiled helper.

pyverbs' ``DmaBufMR`` registers only its own DRM/Habana buffer objects and fixes the
iova to the offset; kvbeam registers the engine's raw fd at an iova of its own choosing
(``kvbeam.server.engines.dmabuf``: an address range the daemon reserved, so a dma-buf region is
addressed like any other region and the transport's checks stay as they are). The
helper ``kvbeam.transport.verbs._dmabuf`` calls libibverbs' ``ibv_reg_dmabuf_mr`` on the
transport's PD; without it (not built) registration is refused, naming it.
"""

from __future__ import annotations

import logging
from typing import Any

from kvbeam.compiled import load_helper
from kvbeam.errors import TransportError

log = logging.getLogger(__name__)

_helper, HELPER_LINE = load_helper("kvbeam.transport.verbs._dmabuf",
                                   "ibv_reg_dmabuf_mr on the transport's PD",
                                   "no dma-buf registration")


def helper_missing() -> str:
    """Why dma-buf memory cannot be registered here ("" when it can be tried)."""
    if _helper is None:
        return HELPER_LINE
    why: str = _helper.available()
    return f"libibverbs: {why}" if why else ""


class DmaBufMR:
    """One ``ibv_reg_dmabuf_mr`` registration; :meth:`close` deregisters it (once).

    Raises TransportError (with the verbs errno's text) when the device refuses.
    """

    def __init__(self, pd: Any, fd: int, offset: int, length: int, iova: int,
                 remote_write: bool, device: str) -> None:
        missing = helper_missing()
        if missing:
            raise TransportError(f"cannot register dma-buf memory on {device}: {missing}")
        assert _helper is not None
        access = _helper.ACCESS_LOCAL_WRITE | (_helper.ACCESS_REMOTE_WRITE if remote_write
                                               else 0)
        try:
            self._mr, self.lkey, self.rkey = _helper.reg(pd, offset, length, iova, fd, access)
        except OSError as exc:
            raise TransportError(f"ibv_reg_dmabuf_mr of {length} bytes at offset {offset} of "
                                 f"dma-buf fd {fd} on {device} failed: {exc.strerror} "
                                 f"(errno {exc.errno})", status=str(exc.errno)) from None
        except (TypeError, ValueError) as exc:
            raise TransportError(f"cannot register dma-buf memory on {device}: {exc}") from None
        self.length = length
        self.iova = iova

    def close(self) -> None:
        """Deregister (before the PD closes; windows never lie over it)."""
        mr, self._mr = self._mr, 0
        if mr and _helper is not None:
            try:
                _helper.dereg(mr)
            except OSError as exc:
                log.warning("ibv_dereg_mr of a dma-buf MR failed: %s", exc)
