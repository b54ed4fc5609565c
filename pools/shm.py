"""Shareable host memory: memfd files mapped MAP_SHARED (no torch).

An engine allocates its pools here (:mod:`kvbeam.engine.memory`) and passes the fds
to its daemon, which maps the same pages (:mod:`kvbeam.pools.shared`). memfd pages
are shmem: RDMA registration pins them (unlike ext4/xfs file mappings).
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import stat
from collections.abc import Sequence

from kvbeam.errors import AttachError

log = logging.getLogger(__name__)


def create_memfd(name: str, nbytes: int) -> int:
    """A new memfd of ``nbytes`` (zero-filled, sealed against nothing; the caller owns it)."""
    fd = os.memfd_create(f"kvbeam.{name}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def shared_file_size(fd: int, what: str) -> int:
    """Size of a regular (memfd/tmpfs) file; refuses anything else, naming ``what``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise AttachError(f"{what}: not a regular file or memfd (mode {st.st_mode:o})", what)
    if st.st_size <= 0:
        raise AttachError(f"{what}: the file is empty", what)
    return st.st_size


def map_shared(fd: int, nbytes: int) -> mmap.mmap:
    """Map the first ``nbytes`` of ``fd`` MAP_SHARED, readable and writable.

    Writable on both roles: a remote-write MR (decode) needs it, and registering a
    local-access MR asks for local write too. The fd may be closed afterwards.
    """
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def unmap(maps: Sequence[mmap.mmap]) -> int:
    """Unmap ``maps``; returns how many are still referenced (unmapped when released).

    Cached digest views of a side die with the side (a weak-keyed cache): drop every
    reference to the side before calling this.
    """
    gc.collect()
    left = 0
    for m in maps:
        try:
            m.close()
        except BufferError:
            left += 1
    if left:
        log.warning("%d shared mapping(s) still referenced; unmapped when released", left)
    return left
