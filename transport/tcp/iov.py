"""Vectored socket I/O straight from (address, length) arrays: ``writev``/``readv`` via ctypes.

Python's ``sendmsg``/``recvmsg_into`` want one buffer object per block, and
building those cost ~1 us of Python per block on each side, the larger part of a
fragmented request's TCP cost (thousands of blocks). Here the ``struct iovec``
array is a numpy array built in one step from the block arrays, and one ctypes
call (which releases the GIL) moves up to IOV_MAX blocks; a partial transfer
resumes inside the block where it stopped.

The socket keeps its Python timeout semantics: a socket with a timeout is
non-blocking underneath, so EAGAIN waits (``poll``) up to that timeout for
progress and raises TimeoutError when none comes.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import select
import socket
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

_libc = ctypes.CDLL(None, use_errno=True)
_IOV_CALLS = {}
for _name in ("writev", "readv"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    _fn.restype = ctypes.c_ssize_t
    _IOV_CALLS[_name] = _fn
# struct iovec is {void *iov_base; size_t iov_len}: two 64-bit words on the 64-bit Linux
# kvbeam runs on.
assert ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(ctypes.c_size_t) == 8

#: iovecs one call takes (the kernel's IOV_MAX, usually 1024).
IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024,
                      1024))


def _wait(sock: socket.socket, reading: bool) -> None:
    timeout = sock.gettimeout()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN if reading else select.POLLOUT)
    if not poller.poll(None if timeout is None else int(timeout * 1000) + 1):
        raise TimeoutError("timed out")


def transfer(sock: socket.socket, addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64],
             *, reading: bool, progress: Callable[[], None] | None = None) -> None:
    """Write (or read into) every ``[addrs[i], addrs[i] + lengths[i])`` in order, all bytes.

    The caller guarantees each range is memory of this process it may read (or
    write). ``progress`` is called after every call that moved bytes. Reading
    raises ConnectionError on EOF before the last byte.
    """
    if len(addrs) == 0:
        return
    call = _IOV_CALLS["readv" if reading else "writev"]
    iov = np.empty((len(addrs), 2), dtype=np.uint64)
    iov[:, 0] = addrs
    iov[:, 1] = lengths
    ends = np.cumsum(iov[:, 1]).tolist()  # a list: bisect per call beats a numpy call
    total, done, i = ends[-1], 0, 0
    fd = sock.fileno()
    while done < total:
        n = call(fd, iov.ctypes.data + i * 16, min(IOV_MAX, len(iov) - i))
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                _wait(sock, reading)
                continue
            raise OSError(err, os.strerror(err))
        if n == 0:
            raise ConnectionError(f"peer closed the connection mid-frame ({done}/{total})")
        done += n
        if progress is not None:
            progress()
        i = bisect.bisect_right(ends, done)
        if i < len(iov):  # resume inside block i: skip the part already moved
            start = ends[i] - int(lengths[i])
            iov[i, 0] = int(addrs[i]) + (done - start)
            iov[i, 1] = ends[i] - done
