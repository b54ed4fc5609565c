"""sglang's ``KVArgs`` (raw pointers) as kvbeam's attach description, and index mapping.

sglang hands a backend only pointers, lengths and item lengths: the main KV buffers,
then one positional list per state component (``state_types``), the draft's last. The
engine's pools must live in size-sealed memfds (e.g. :class:`kvbeam.engine.EnginePools`
or :class:`kvbeam.engine.SharedMemory`; the daemon refuses unsealed ones) whose fds the
process still holds:
each pointer is found in ``/proc/self/maps`` and its mapping's file matched, by device
and inode, to an open fd. No sglang import here (the adapters pass its objects in).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbeam.engine import EngineBuffers
from kvbeam.errors import AttachError
from kvbeam.pools.layout import ComponentLayout, SideLayout
from kvbeam.pools.types import StateType
from kvbeam.proto.attach_codec import BufferRef

#: kvbeam's state component type -> sglang's ``StateType`` value (``KVArgs.state_types``).
SGLANG_STATE_TYPE = {StateType.SWA: "swa", StateType.SWA_RING: "swa_ring",
                     StateType.C128_STATE: "c128_state"}
#: The name kvbeam gives sglang's metadata buffers (``KVArgs.aux_*``), not a state type:
#: the last component when the layout has an ``AUX`` component (the sglang_mha kind).
AUX = "aux"


def has_aux(layout: SideLayout | None) -> bool:
    """True when ``layout`` moves sglang's metadata rows (an ``AUX`` component)."""
    return layout is not None and any(c.state_type is StateType.AUX for c in layout.states)


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    offset: int
    dev_ino: tuple[int, int]


def _maps() -> list[_Mapping]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or int(parts[4]) == 0:
                continue  # anonymous memory: no file to hand over
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            out.append(_Mapping(lo, hi, int(parts[2], 16), (os.makedev(major, minor),
                                                             int(parts[4]))))
    return out


def _open_fds() -> dict[tuple[int, int], int]:
    """Open fds of regular files by (device, inode); the lowest fd wins."""
    out: dict[tuple[int, int], int] = {}
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            st = os.fstat(int(name))
        except OSError:
            continue
        out.setdefault((st.st_dev, st.st_ino), int(name))
    return out


def kvargs_components(kv_args: Any, layout: SideLayout | None = None
                      ) -> list[tuple[str, list[int], list[int], list[int]]]:
    """``KVArgs`` as positional components: (type, ptrs, lens, item_lens), KV first, then
    the state components, then the metadata buffers when ``layout`` moves them."""
    comps = [("kv", list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens),
              list(kv_args.kv_item_lens))]
    for st, ptrs, lens, items in zip(kv_args.state_types, kv_args.state_data_ptrs,
                                     kv_args.state_data_lens, kv_args.state_item_lens,
                                     strict=True):
        comps.append((str(getattr(st, "value", st)), list(ptrs), list(lens), list(items)))
    if has_aux(layout):
        comps.append((AUX, list(kv_args.aux_data_ptrs), list(kv_args.aux_data_lens),
                      list(kv_args.aux_item_lens)))
    return comps


def check_kvargs(kv_args: Any, layout: SideLayout) -> None:
    """Refuse ``KVArgs`` whose components do not describe ``layout`` (type, count, sizes)."""
    comps = kvargs_components(kv_args, layout)
    want = [("kv", c) if c.state_type is None else
            (AUX if c.state_type is StateType.AUX else SGLANG_STATE_TYPE[c.state_type], c)
            for c in layout.components]
    got_types = [c[0] for c in comps]
    if got_types != [w[0] for w in want]:
        raise AttachError(f"KVArgs state components {got_types[1:]} do not match the kvbeam "
                          f"config's {[w[0] for w in want][1:]}", "state_types")
    for i, ((_, ptrs, lens, items), (_, comp)) in enumerate(zip(comps, want, strict=True)):
        sizes = [(b.nbytes, b.item_len) for b in comp.buffers]
        if list(zip(lens, items, strict=True)) != sizes or len(ptrs) != len(sizes):
            raise AttachError(f"KVArgs component {i} ({comp.name}): (length, item length) "
                              f"{list(zip(lens, items, strict=True))} != the layout's {sizes}",
                              f"components[{i}]")


def buffers_from_kvargs(kv_args: Any, layout: SideLayout | None = None) -> EngineBuffers:
    """The attach description of the memory ``KVArgs`` points at (fds duplicated); the
    metadata buffers too when ``layout`` moves them.

    Raises:
        AttachError: a pointer is not inside a file mapping whose fd this process holds
            (the engine must allocate its pools in memfds and keep the fds open).
    """
    maps, fds = _maps(), _open_fds()
    index: dict[int, int] = {}
    out = EngineBuffers([])
    try:
        for ci, (_, ptrs, lens, items) in enumerate(kvargs_components(kv_args, layout)):
            refs = []
            for bi, (ptr, n, item) in enumerate(zip(ptrs, lens, items, strict=True)):
                m = next((m for m in maps if m.start <= ptr and ptr + n <= m.end), None)
                fd = fds.get(m.dev_ino) if m else None
                if m is None or fd is None:
                    raise AttachError(f"KVArgs component {ci} buffer {bi} at {ptr:#x} is not "
                                      "in shareable memory this process holds an fd of "
                                      "(allocate the pools in memfds)", f"components[{ci}][{bi}]")
                if fd not in index:
                    index[fd] = len(out.fds)
                    out.fds.append(os.dup(fd))
                refs.append(BufferRef(index[fd], ptr - m.start + m.offset, n, item))
            out.components.append(refs)
    except BaseException:
        for fd in out.fds:
            os.close(fd)
        raise
    return out


def state_index_lists(layout: SideLayout, state_indices: Sequence[Any] | None
                      ) -> dict[str, Any]:
    """sglang's positional ``state_indices`` as kvbeam's lists by kind name.

    Entry ``i`` belongs to state component ``i`` (``KVArgs.state_types`` order). A
    component whose buffers use one index kind takes an array; one with several
    (kvbeam's SWA component holds the C4 compression state, ``REQ_SLOT``, beside its
    SWA pages) takes a mapping kind -> array. ``None`` leaves the component out: for
    the draft (last), its lists are then the target's, as sglang's shared allocator.
    """
    out: dict[str, Any] = {}
    states = tuple(c for c in layout.states if c.state_type is not StateType.AUX)
    entries = list(state_indices or [])
    if len(entries) > len(states):
        raise ValueError(f"{len(entries)} state index entries for {len(states)} components")
    for comp, entry in zip(states, entries, strict=False):
        if entry is None:
            continue
        prefix = "draft." if comp.pool == "draft" else ""
        for kind, lst in _entry_lists(comp, entry).items():
            out[prefix + kind] = lst
    return out


def _entry_lists(comp: ComponentLayout, entry: Any) -> dict[str, Any]:
    kinds = sorted({b.index_kind.name for b in comp.buffers})
    if isinstance(entry, Mapping):
        unknown = set(entry) - set(kinds)
        if unknown:
            raise ValueError(f"{comp.name}: index kinds {sorted(unknown)} not in {kinds}")
        return dict(entry)
    if len(kinds) != 1:
        raise ValueError(f"{comp.name} holds index kinds {kinds}: pass a mapping kind -> list")
    return {kinds[0]: entry}
