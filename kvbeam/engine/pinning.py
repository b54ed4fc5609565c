"""Page-locking an engine's host buffer for its GPU: ``cudaHostRegister`` on memfd mappings.

A staging buffer (:mod:`kvbeam.engine.staging`) lives in memfds its daemon maps too;
copies between the GPU and it run at full PCIe/NVLink rate, asynchronously on a side
stream, only when CUDA knows the pages are locked. :class:`PinnedHost` registers each
mapping (page-aligned, ``MAP_SHARED``) with the CUDA runtime that torch loaded and
unregisters it on :meth:`PinnedHost.close`; an engine process that dies has its
registrations dropped by the driver with the process. On CPU there is nothing to pin.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbeam.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process.
_PORTABLE = 1


class PinnedHost:
    """CUDA page-locks ``views`` (whole host mappings, uint8 tensors) until :meth:`close`."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        import torch

        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self._ptrs: list[int] = []
        self.nbytes = 0
        try:
            for v in views:
                ptr, size = int(v.data_ptr()), v.numel() * v.element_size()
                code = int(self._cudart.cudaHostRegister(ptr, size, _PORTABLE))
                if code != 0:
                    raise ConfigError(
                        f"staging: cudaHostRegister of {size} bytes at {ptr:#x} failed with "
                        f"cudaError {code} ({self._error(code)}): the staging buffer cannot "
                        "be pinned (is RLIMIT_MEMLOCK or the GPU driver's pinned limit too "
                        "low?)")
                self._ptrs.append(ptr)
                self.nbytes += size
        except BaseException:
            self.close()
            raise
        log.info("staging: %d host mapping(s), %.1f MiB pinned for CUDA", len(self._ptrs),
                 self.nbytes / 2**20)

    def _error(self, code: int) -> str:
        try:
            return str(self._cudart.cudaGetErrorString(self._cudart.cudaError(code)))
        except (AttributeError, TypeError, ValueError):
            return "no description"

    @property
    def count(self) -> int:
        """Mappings registered now."""
        return len(self._ptrs)

    def close(self) -> None:
        """Unregister every mapping (before they are unmapped)."""
        ptrs, self._ptrs = self._ptrs, []
        for ptr in ptrs:
            code = int(self._cudart.cudaHostUnregister(ptr))
            if code != 0:
                log.warning("staging: cudaHostUnregister(%#x) failed with cudaError %d (%s)",
                            ptr, code, self._error(code))
        self.nbytes = 0
