"""Check an engine's attach description and map its memory: the daemon side of attach.

The checks run in this order, each refusal naming its field: the memory kind (a
``dmabuf`` attach: whether this daemon takes one, :mod:`kvbeam.server.engines.dmabuf`), the
engine's config against ``--config`` (when the daemon has one), the seed's
target/draft checks (:func:`~kvbeam.pools.checks.check_target_draft`: the same checks
and wording as the daemon's start-up), the component and buffer counts, every
buffer's length and item length against the layout the config gives, every fd of its
kind (size-sealed memfds, or dma-bufs), every buffer inside its fd, no two buffers
overlapping. Only then is anything mapped.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvbeam.errors import AttachError, PoolCompatibilityError
from kvbeam.pools.checks import check_target_draft
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.shared import MappedSide, Placement, placed_layout
from kvbeam.pools.shm import map_shared, shared_file_size, unmap
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.attach_codec import AttachRequest, BufferRef, config_differences
from kvbeam.server.engines.dmabuf import DmabufAccess, DmabufMemory

log = logging.getLogger(__name__)

#: What a dma-buf attach is answered by a caller that takes no dma-buf memory.
DMABUF_REFUSED = ("memory_kind dmabuf: this daemon takes host memory only here: attach "
                  "host shared memory (memory_kind host_shm)")


@dataclass(frozen=True)
class EngineMemory:
    """An accepted attach: the engine's config and its pools, mapped here (for a dma-buf
    over RDMA: address ranges reserved for it, ``dmabuf`` holding the fds to register)."""

    config: SideConfig
    layout: SideLayout
    side: MappedSide
    dmabuf: DmabufMemory | None = None


def check_description(req: AttachRequest, role: str,
                      expected: SideConfig | None) -> tuple[SideConfig, SideLayout]:
    """Everything that needs no fd: kind, config, seed checks, counts, lengths.

    Returns the engine's config and the layout it gives (kvbeam's own offsets).
    """
    config = req.config
    if config is None:
        raise AttachError("config: missing", "config")
    if expected is not None:
        diffs = config_differences(expected, config)
        if diffs:
            raise AttachError(f"config: the engine's config differs from this daemon's "
                              f"--config ({expected.source}): {'; '.join(diffs)}", "config")
    layout = build_side_layout(config)
    try:
        check_target_draft(layout, role)
    except PoolCompatibilityError as exc:
        raise AttachError(f"config.draft: {exc}", "config.draft") from None
    want = layout.components
    if len(req.components) != len(want):
        raise AttachError(
            f"components: {len(req.components)} given, the config's layout has {len(want)} "
            f"({', '.join(c.name for c in want)})", "components")
    for i, (got, comp) in enumerate(zip(req.components, want, strict=True)):
        if len(got) != len(comp.buffers):
            raise AttachError(f"components[{i}] ({comp.name}): {len(got)} buffers given, the "
                              f"layout has {len(comp.buffers)}", f"components[{i}]")
        for j, (ref, buf) in enumerate(zip(got, comp.buffers, strict=True)):
            where = f"components[{i}][{j}]"
            for name, have, need in (("length", ref.length, buf.nbytes),
                                     ("item_len", ref.item_len, buf.item_len)):
                if have != need:
                    raise AttachError(f"{where}.{name} ({buf.name}): engine={have}, "
                                      f"layout={need}", f"{where}.{name}")
    return config, layout


def _check_placement(refs: Sequence[tuple[str, BufferRef]], sizes: dict[int, int]) -> None:
    """Every buffer inside its fd; no two buffers of one fd overlapping."""
    by_fd: dict[int, list[tuple[int, int, str]]] = {}
    for where, ref in refs:
        size = sizes[ref.fd_index]
        if ref.offset + ref.length > size:
            raise AttachError(f"{where}: offset {ref.offset} + length {ref.length} = "
                              f"{ref.offset + ref.length} is past the end of fd "
                              f"{ref.fd_index} ({size} bytes)", f"{where}.offset")
        by_fd.setdefault(ref.fd_index, []).append((ref.offset, ref.length, where))
    for fd_index, spans in by_fd.items():
        spans.sort()
        for (a_off, a_len, a), (b_off, _, b) in itertools.pairwise(spans):
            if b_off < a_off + a_len:
                raise AttachError(f"{b}: overlaps {a} in fd {fd_index} (offset {b_off} < "
                                  f"{a_off} + {a_len})", f"{b}.offset")


def _holders(fd_index: int, req: AttachRequest, layout: SideLayout) -> str:
    """The buffers fd ``fd_index`` holds, for a refusal: the first one and how many more."""
    names = [f"components[{i}][{j}] {buf.name}"
             for i, (comp, want) in enumerate(zip(req.components, layout.components,
                                                  strict=True))
             for j, (ref, buf) in enumerate(zip(comp, want.buffers, strict=True))
             if ref.fd_index == fd_index]
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def map_engine_memory(req: AttachRequest, fds: list[int], role: str,
                      expected: SideConfig | None, *,
                      dmabuf: DmabufAccess | None = None) -> EngineMemory:
    """Check the description, then map the fds it uses. Closes every fd in ``fds``
    (the mappings keep the memory; nothing here keeps a descriptor, except a dma-buf
    attach's duplicates in :attr:`EngineMemory.dmabuf`, which the caller closes once
    it registered them). ``dmabuf``: how this daemon takes ``memory_kind: dmabuf``
    (None: refused)."""
    maps = []
    kept: list[int] = []
    try:
        if req.memory_kind == "dmabuf":
            if dmabuf is None:
                raise AttachError(DMABUF_REFUSED, "memory_kind")
            dmabuf.check_allowed()
        else:
            dmabuf = None
        config, layout = check_description(req, role, expected)
        refs = [(f"components[{i}][{j}]", ref) for i, comp in enumerate(req.components)
                for j, ref in enumerate(comp)]
        used = sorted({ref.fd_index for _, ref in refs})
        size_of = dmabuf.size if dmabuf is not None else shared_file_size
        sizes = {k: size_of(fds[k], f"fds[{k}]", _holders(k, req, layout)) for k in used}
        _check_placement(refs, sizes)
        slot = {k: n for n, k in enumerate(used)}
        for k in used:
            if dmabuf is not None:
                maps.append(dmabuf.map(fds[k], sizes[k], f"fds[{k}]"))
                kept.append(os.dup(fds[k]))
            else:
                maps.append(map_shared(fds[k], sizes[k]))
        placements = [[Placement(slot[r.fd_index], r.offset) for r in comp]
                      for comp in req.components]
        mapped = placed_layout(layout, placements, [sizes[k] for k in used])
        side = MappedSide(mapped, maps)
        held = (DmabufMemory(tuple(kept), tuple(side.tensor_regions()))
                if dmabuf is not None else None)
    except BaseException:
        unmap(maps)
        for fd in kept:
            os.close(fd)
        raise
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    log.info("engine memory %s: %d fd(s), %.1f MiB",
             "mapped" if dmabuf is None else f"(dma-buf, {dmabuf.transport.kind}) taken",
             len(maps), side.mapped_bytes / 2**20)
    return EngineMemory(config, mapped, side, held)
