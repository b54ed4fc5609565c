"""Real dma-buf fds on a machine without a GPU, for the ``memory_kind: dmabuf`` tests.

- udmabuf (``/dev/udmabuf``, CONFIG_UDMABUF): a dma-buf over a memfd sealed against
  shrinking (``UDMABUF_CREATE``); the memfd's own mapping sees what lands in it.
- vgem (the DRM "virtual GEM" driver, ``modprobe vgem``; the soft-RoCE guest's Debian 6.1
  kernel has it, and no udmabuf): a dumb buffer exported with ``PRIME_HANDLE_TO_FD``; the
  dma-buf itself is mappable.

:func:`make_dmabuf` tries udmabuf, then vgem, and says what it used or why neither
exists. Neither exists on this project's host kernel (no CONFIG_UDMABUF, no DRM).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import mmap
import os
import struct
import subprocess
from dataclasses import dataclass

from kvbeam.pools.layout import SideLayout
from kvbeam.pools.shm import create_memfd
from kvbeam.proto.attach_codec import BufferRef

#: _IOW('u', 0x42, struct udmabuf_create {u32 memfd, flags; u64 offset, size})
UDMABUF_CREATE = 0x40187542
UDMABUF_FLAGS_CLOEXEC = 0x01
#: _IOWR('d', 0xB2, struct drm_mode_create_dumb) and _IOWR('d', 0x2D, struct drm_prime_handle)
DRM_IOCTL_MODE_CREATE_DUMB = 0xC02064B2
DRM_IOCTL_PRIME_HANDLE_TO_FD = 0xC00C642D
_DRM_RDWR = os.O_RDWR
PAGE = 4096


@dataclass
class DmaBufFd:
    """A dma-buf ``fd`` of ``size`` bytes made by ``how``; ``view`` maps its bytes for the
    test (the memfd behind a udmabuf, or the dma-buf itself)."""

    fd: int
    size: int
    how: str
    view: mmap.mmap
    _keep: tuple[int, ...] = ()

    def close(self) -> None:
        """Close the fd, its mapping and what backs it."""
        with contextlib.suppress(BufferError):
            self.view.close()
        for fd in (self.fd, *self._keep):
            with contextlib.suppress(OSError):
                os.close(fd)


def udmabuf(size: int) -> DmaBufFd:
    """A udmabuf of ``size`` bytes (page-rounded) over a fresh size-sealed memfd."""
    size = -(-size // PAGE) * PAGE
    dev = os.open("/dev/udmabuf", os.O_RDWR | os.O_CLOEXEC)
    memfd = create_memfd("udmabuf", size)  # F_SEAL_SHRINK (and GROW), as udmabuf requires
    try:
        arg = bytearray(struct.pack("=IIQQ", memfd, UDMABUF_FLAGS_CLOEXEC, 0, size))
        fd = fcntl.ioctl(dev, UDMABUF_CREATE, arg, True)
    except BaseException:
        os.close(memfd)
        raise
    finally:
        os.close(dev)
    view = mmap.mmap(memfd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return DmaBufFd(fd, size, "udmabuf", view, (memfd,))


def vgem_card() -> str:
    """The vgem DRM node (loading the module when absent); "" when there is none."""
    def find() -> str:
        for card in sorted(glob.glob("/sys/class/drm/card[0-9]*")):
            if "-" in os.path.basename(card):
                continue  # a connector, not a device
            # vgem's parent is a platform device named vgem, bound to no driver.
            device = os.path.realpath(os.path.join(card, "device"))
            driver = os.path.join(card, "device", "driver")
            names = {os.path.basename(device)}
            with contextlib.suppress(OSError):
                names.add(os.path.basename(os.readlink(driver)))
            if "vgem" in names:
                return f"/dev/dri/{os.path.basename(card)}"
        return ""

    card = find()
    if not card:
        subprocess.run(["modprobe", "vgem"], capture_output=True, check=False)
        card = find()
    return card if card and os.path.exists(card) else ""


def vgem_dmabuf(size: int) -> DmaBufFd:
    """A vgem dumb buffer of at least ``size`` bytes, exported as a dma-buf."""
    card = vgem_card()
    if not card:
        raise OSError("no vgem device (modprobe vgem failed or /dev/dri is missing)")
    dev = os.open(card, os.O_RDWR | os.O_CLOEXEC)
    try:
        width = 1024  # 4 bytes a pixel: 4 KiB a row
        height = -(-size // (4 * width))
        dumb = bytearray(struct.pack("=IIIIIIQ", height, width, 32, 0, 0, 0, 0))
        fcntl.ioctl(dev, DRM_IOCTL_MODE_CREATE_DUMB, dumb, True)
        handle = struct.unpack_from("=I", dumb, 16)[0]
        real = struct.unpack_from("=Q", dumb, 24)[0]
        prime = bytearray(struct.pack("=IIi", handle, os.O_CLOEXEC | _DRM_RDWR, -1))
        fcntl.ioctl(dev, DRM_IOCTL_PRIME_HANDLE_TO_FD, prime, True)
        fd = struct.unpack_from("=i", prime, 8)[0]
    except BaseException:
        os.close(dev)
        raise
    view = mmap.mmap(fd, real, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return DmaBufFd(fd, real, f"vgem ({card})", view, (dev,))


def packed_buffers(layout: SideLayout) -> tuple[int, list[list[BufferRef]]]:
    """Every buffer of ``layout`` in one fd (index 0), page-aligned in layout order: the
    size it needs and each component's buffer places."""
    at = 0
    comps = []
    for comp in layout.components:
        refs = []
        for b in comp.buffers:
            refs.append(BufferRef(0, at, b.nbytes, b.item_len))
            at += -(-b.nbytes // PAGE) * PAGE
        comps.append(refs)
    return at, comps


def make_dmabuf(size: int) -> DmaBufFd:
    """A dma-buf of at least ``size`` bytes from udmabuf or vgem; OSError naming why
    neither could make one."""
    why = []
    if os.path.exists("/dev/udmabuf"):
        try:
            return udmabuf(size)
        except OSError as exc:
            why.append(f"udmabuf: {exc}")
    else:
        why.append("no /dev/udmabuf (CONFIG_UDMABUF)")
    try:
        return vgem_dmabuf(size)
    except OSError as exc:
        why.append(f"vgem: {exc}")
    raise OSError("no dma-buf exporter on this machine: " + "; ".join(why))
