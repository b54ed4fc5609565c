"""Every memfd kvbeam creates for an engine is sealed against resizing (pools/shm.py),
and the daemon's size check refuses what is not shared memory or not sealed."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
import torch

from kvbeam.engine import EnginePools, SharedMemory
from kvbeam.errors import AttachError
from kvbeam.pools.shm import (
    SIZE_SEALS,
    TMPFS_MAGIC,
    create_memfd,
    filesystem_type,
    shared_file_size,
)
from tests.fixtures import side


def _assert_size_fixed(fd: int) -> None:
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SIZE_SEALS == SIZE_SEALS
    size = os.fstat(fd).st_size
    for nbytes in (0, size // 2, size * 2):
        with pytest.raises(OSError) as exc:
            os.ftruncate(fd, nbytes)
        assert exc.value.errno == errno.EPERM
    assert os.fstat(fd).st_size == size


def test_engine_pools_memfds_are_sealed_against_resizing() -> None:
    with EnginePools(side()) as pools:
        assert pools.fds
        for fd in pools.fds:
            _assert_size_fixed(fd)
            assert shared_file_size(fd, "fds[0]") == os.fstat(fd).st_size


def test_shared_memory_memfds_are_sealed_against_resizing() -> None:
    # What the vLLM connector moves vLLM's KV allocation into.
    shared = SharedMemory()
    try:
        out = shared.share(torch.arange(1024, dtype=torch.int32), "kv")
        assert out[1023] == 1023
        (fd,) = shared.fds
        _assert_size_fixed(fd)
    finally:
        shared.close()


def test_a_memfd_is_on_tmpfs_and_the_size_check_names_the_fd_and_its_buffers() -> None:
    fd = create_memfd("probe", 4096)
    plain = os.memfd_create("kvbeam.plain", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        assert filesystem_type(fd) == TMPFS_MAGIC
        os.ftruncate(plain, 4096)
        with pytest.raises(AttachError, match=r"^fds\[3\] \(components\[0\]\[0\] kv\): not "
                                              r"sealed against resizing \(seals 0x0") as exc:
            shared_file_size(plain, "fds[3]", "components[0][0] kv")
        assert exc.value.field == "fds[3]"
        fcntl.fcntl(plain, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_WRITE)
        with pytest.raises(AttachError, match=r"sealed against writing \(seals 0xe\)"):
            shared_file_size(plain, "fds[3]")
    finally:
        os.close(fd)
        os.close(plain)
