"""Shareable host memory: sealed memfds mapped MAP_SHARED (no torch).

An engine allocates its pools here (:mod:`kvbeam.engine.memory`) and passes the fds
to its daemon, which maps the same pages (:mod:`kvbeam.pools.shared`). memfd pages
are shmem: RDMA registration pins them (unlike ext4/xfs file mappings).

Every memfd is sealed against shrinking and growing before it is handed over
(:func:`create_memfd`, :func:`seal_size`), and the daemon refuses one that is not
(:func:`shared_file_size`): the daemon takes the size once, at attach, and a file cut
shorter afterwards would turn its next read or write of the mapping into SIGBUS.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import logging
import mmap
import os
import stat
from collections.abc import Sequence

from kvbeam.errors import AttachError

log = logging.getLogger(__name__)

#: The seals every attached memfd carries: its size is fixed for as long as it lives.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: Seals the daemon cannot work with: it maps the memory writable (decode's landings,
#: and an RDMA registration asks for local write on both roles).
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
#: statfs ``f_type`` of the filesystems shared memory lives on (linux/magic.h); memfds
#: are files of the kernel's internal tmpfs (or hugetlbfs with MFD_HUGETLB).
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
_SHARED_MEMORY_FS = {TMPFS_MAGIC: "tmpfs", HUGETLBFS_MAGIC: "hugetlbfs"}
_FIX = ("create it with memfd_create(MFD_ALLOW_SEALING) and seal it F_SEAL_SHRINK | "
        "F_SEAL_GROW before attaching (kvbeam.pools.shm.create_memfd does both; "
        "kvbeam.engine.EnginePools and SharedMemory use it)")


def seal_size(fd: int) -> None:
    """Seal a memfd (created with ``MFD_ALLOW_SEALING``) against shrinking and growing."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)


def create_memfd(name: str, nbytes: int) -> int:
    """A new memfd of ``nbytes`` (zero-filled, its size sealed; the caller owns it)."""
    fd = os.memfd_create(f"kvbeam.{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        seal_size(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _StatFs(ctypes.Structure):
    # Only f_type (the first member, a long) is read; the rest is room for the kernel's
    # struct statfs (120 bytes on 64-bit Linux).
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 248)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.POINTER(_StatFs)]
_libc.fstatfs.restype = ctypes.c_int


def filesystem_type(fd: int) -> int:
    """The statfs ``f_type`` magic of the filesystem ``fd``'s file is on (``os.fstatvfs``
    does not report it)."""
    buf = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(buf.f_type) & 0xFFFFFFFF


def shared_file_size(fd: int, field: str, used_by: str = "") -> int:
    """Size of a size-sealed memfd; refuses anything else, naming ``field`` (the fd, e.g.
    ``fds[2]``), the buffers it holds (``used_by``) and the fix.

    The checks: a regular file, on tmpfs or hugetlbfs (shared memory: other file
    mappings cannot be pinned for RDMA), sealed against shrinking and growing (so the
    size returned here stays true), not sealed against writing, not empty.
    """
    what = f"{field} ({used_by})" if used_by else field
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise AttachError(f"{what}: not a regular file or memfd (mode {st.st_mode:o}); "
                          f"{_FIX}", field)
    fs_type = filesystem_type(fd)
    if fs_type not in _SHARED_MEMORY_FS:
        raise AttachError(f"{what}: not shared memory: the file is on a filesystem of statfs "
                          f"type {fs_type:#x}, not tmpfs or hugetlbfs; {_FIX}", field)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise AttachError(
            f"{what}: not sealed against resizing (seals {seals:#x}, F_SEAL_SHRINK | "
            f"F_SEAL_GROW needed): the engine could shrink it under the daemon, which "
            f"would then die of SIGBUS (a tmpfs file cannot be sealed, only a memfd); "
            f"{_FIX}", field)
    if seals & _WRITE_SEALS:
        raise AttachError(f"{what}: sealed against writing (seals {seals:#x}): the daemon "
                          "maps the memory writable; seal only F_SEAL_SHRINK | F_SEAL_GROW",
                          field)
    if st.st_size <= 0:
        raise AttachError(f"{what}: the file is empty", field)
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
