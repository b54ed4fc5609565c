"""Vectored socket I/O straight from (address, length) arrays: ``writev``/``readv`` via ctypes.

Python's ``sendmsg``/``recvmsg_into`` want one buffer object per block, and
building those cost ~1 us of Python per block on each side, the larger part of a
fragmented request's TCP cost (thousands of blocks). Here the ``struct iovec``
array is a numpy array built in one step from the block arrays, and one ctypes
call (which releases the GIL) moves up to IOV_MAX blocks; a partial transfer
resumes inside the block where it stopped (:class:`Vectors`), also across calls: the
sockets are non-blocking, so a call moves what the socket takes (or holds) now and the
caller's selector loop calls again when the socket is ready.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
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


class Vectors:
    """Memory ranges ``[addrs[i], addrs[i] + lengths[i])`` to move through a socket in
    order, as one stream: :meth:`move` may stop where the socket has no room (or no
    data) and a later call resumes there, inside the block where it stopped.

    The caller guarantees each range is memory of this process it may read (or
    write) until the stream is done; ``keep`` holds any buffer the ranges point into
    (frame headers built for the stream) alive as long as the stream.
    """

    def __init__(self, addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64],
                 keep: object = None) -> None:
        self._iov = np.empty((len(addrs), 2), dtype=np.uint64)
        self._iov[:, 0] = addrs
        self._iov[:, 1] = lengths
        self._ends: list[int] | None = None
        self._addrs: npt.NDArray[np.uint64] | None = None
        ends = self._index()
        self.total = ends[-1] if ends else 0
        self.done = 0  # bytes moved so far
        self._at = 0  # the first iovec not moved whole
        self._keep = keep

    @classmethod
    def from_iov(cls, rows: bytearray, total: int, *, keep: object = None,
                 count: int | None = None) -> Vectors:
        """A stream of ``struct iovec`` rows built elsewhere (16 bytes each: address,
        length; the compiled blocks helper's, or a received WRITEV frame's descriptors),
        the first ``count`` of them (all by default), ``total`` bytes in all. The rows
        are the stream's own from here on: a partial move rewrites them."""
        self = cls.__new__(cls)
        view = np.frombuffer(rows, dtype=np.uint64).reshape(-1, 2)
        self._iov = view if count is None else view[:count]
        # Where each row ends in the stream, and its address: needed only to resume
        # inside a row, so found then (most streams move in one call).
        self._ends = None
        self._addrs = None
        self.total = total
        self.done = 0
        self._at = 0
        self._keep = (keep, rows)
        return self

    def _index(self) -> list[int]:
        """Each row's end in the stream (a list: bisect per call beats a numpy call) and
        its address, from the rows before any was rewritten."""
        self._addrs = self._iov[:, 0].copy()
        self._ends = np.cumsum(self._iov[:, 1]).tolist() if len(self._iov) else []
        return self._ends

    def move(self, sock: socket.socket, *, reading: bool,
             progress: Callable[[], None] | None = None) -> bool:
        """Move bytes until the stream is done (True) or until the (non-blocking) socket
        would block (False: call again when it is ready to go on).

        ``progress`` is called after every call that moved bytes. Reading raises
        ConnectionError on EOF before the last byte.
        """
        call = _IOV_CALLS["readv" if reading else "writev"]
        iov = self._iov
        fd = sock.fileno()
        while self.done < self.total:
            i = self._at
            n = call(fd, iov.ctypes.data + i * 16, min(IOV_MAX, len(iov) - i))
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return False
                raise OSError(err, os.strerror(err))
            if n == 0:
                raise ConnectionError(f"peer closed the connection mid-frame "
                                      f"({self.done}/{self.total})")
            self.done += n
            if progress is not None:
                progress()
            if self.done < self.total:  # resume inside block i: skip the part already moved
                ends = self._ends if self._ends is not None else self._index()
                assert self._addrs is not None
                i = self._at = bisect.bisect_right(ends, self.done)
                start = ends[i - 1] if i else 0
                iov[i, 0] = int(self._addrs[i]) + (self.done - start)
                iov[i, 1] = ends[i] - self.done
        return True
