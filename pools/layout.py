"""Pool layouts: the allocations, buffers and positional components of one side.

A layout is pure data (no torch): the daemon allocates it (``kvbeam.pools.allocate``),
the handshake sends it to the peer, and the checks compare two of them.

Buffer order follows sglang's wire layout:

- main KV (``get_contiguous_buf_infos``): C4 KV layers, C4 indexer layers, C128 KV
  layers. In unified mode a layer's KV region starts after its SWA ring rows.
- state components, positional: target ``SWA`` (paged SWA pages, then C4
  compression states), then ``SWA_RING`` if unified, then ``C128_STATE`` if any
  C128 layer, then the draft component LAST (``SWA_RING`` unified, ``SWA`` paged).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvbeam.pools.indices import swa_index_mapping_fingerprint
from kvbeam.pools.paged import block_bytes, num_blocks
from kvbeam.pools.sglang_mha import page_bytes
from kvbeam.pools.spec import STATE_ELEMENT_SIZE, PoolSpec, SideConfig
from kvbeam.pools.types import IndexKind, StateType


@dataclass(frozen=True)
class TensorLayout:
    """One allocation (a flat byte tensor)."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class BufferLayout:
    """A transferable buffer: ``nbytes`` at ``offset`` in a tensor, cut in ``item_len`` items."""

    name: str
    tensor: int
    offset: int
    nbytes: int
    item_len: int
    index_kind: IndexKind

    @property
    def items(self) -> int:
        """Number of whole items the buffer holds (valid indices are ``0..items-1``)."""
        return self.nbytes // self.item_len


@dataclass(frozen=True)
class ComponentLayout:
    """A positional component: the main KV buffers (``state_type`` None) or one state component."""

    name: str
    pool: str
    state_type: StateType | None
    buffers: tuple[BufferLayout, ...]


@dataclass(frozen=True)
class PoolGeometry:
    """The fields of a pool spec that decide what its bytes mean; what checks compare."""

    compression_ratios: tuple[int, ...]
    unified_kv: bool
    sliding_window: int
    swa_ring_size: int
    swa_pages: int
    page_size: int
    head_dim: int
    indexer_head_dim: int
    dtype: str
    num_draft_tokens: int
    online_c128: bool
    c4_ring_size: int
    c128_ring_size: int
    swa_pages_per_req: int
    num_req_slots: int
    max_context_len: int
    swa_index_mapping: str
    kind: str = "dsv4"
    num_kv_heads: int = 1
    inner_layout: str = ""
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of(cls, spec: PoolSpec) -> PoolGeometry:
        """Summarise a spec."""
        return cls(
            compression_ratios=spec.compression_ratios,
            unified_kv=spec.unified_kv,
            sliding_window=spec.sliding_window,
            swa_ring_size=spec.ring_size,
            swa_pages=spec.swa_pages,
            page_size=spec.page_size,
            head_dim=spec.head_dim,
            indexer_head_dim=spec.indexer_head_dim,
            dtype=spec.dtype,
            num_draft_tokens=spec.num_draft_tokens,
            online_c128=spec.online_c128,
            c4_ring_size=spec.c4_ring_size,
            c128_ring_size=spec.c128_ring_size,
            swa_pages_per_req=spec.swa_pages_per_request,
            num_req_slots=spec.num_req_slots,
            max_context_len=spec.max_context_len,
            swa_index_mapping=swa_index_mapping_fingerprint(spec),
            kind=spec.kind,
            num_kv_heads=spec.num_kv_heads,
            inner_layout=spec.inner_layout,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
        )


_V = TypeVar("_V")


class LayoutCache(Generic[_V]):
    """Values derived from a layout once and reused for every request that uses it.

    Keyed by the layout's identity (and a hashable ``extra``), not its value: hashing a
    frozen layout's ~180 buffers on every lookup would cost more than the work cached.
    Each entry holds its layout, so its id cannot be reused while the entry stands; a
    daemon sees a handful of layouts, so the cache is simply emptied when full.
    """

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._entries: dict[tuple[int, Hashable], tuple[SideLayout, _V]] = {}

    def get(self, layout: SideLayout, extra: Hashable,
            make: Callable[[], _V]) -> _V:
        """The value for ``layout`` and ``extra``; ``make()`` computes it the first time."""
        key = (id(layout), extra)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is layout:
            return hit[1]
        value = make()
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[key] = (layout, value)
        return value


@dataclass(frozen=True)
class SideLayout:
    """Everything one side allocates and exposes, in positional order."""

    model: str
    target: PoolGeometry
    draft: PoolGeometry | None
    tensors: tuple[TensorLayout, ...]
    kv: ComponentLayout
    states: tuple[ComponentLayout, ...]

    # components and flat_buffers are read several times per request (plans, digests,
    # sub-batches): built once per layout (the fields are frozen), not per read.
    @functools.cached_property
    def components(self) -> tuple[ComponentLayout, ...]:
        """Main KV first, then the state components in order (the draft's last)."""
        return (self.kv, *self.states)

    @property
    def state_types(self) -> list[StateType]:
        """The positional state component types, e.g. ``[SWA, SWA_RING, SWA_RING]``."""
        return [c.state_type for c in self.states if c.state_type is not None]

    @functools.cached_property
    def flat_buffers(self) -> tuple[BufferLayout, ...]:
        """Every buffer in positional order; the handshake's region list follows it."""
        return tuple(b for c in self.components for b in c.buffers)

    @functools.cached_property
    def component_offsets(self) -> tuple[int, ...]:
        """Each component's first position in :attr:`flat_buffers`."""
        out, at = [], 0
        for c in self.components:
            out.append(at)
            at += len(c.buffers)
        return tuple(out)

    @property
    def total_bytes(self) -> int:
        """Bytes allocated for all tensors."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_layers(self) -> int:
        """The target model's layers (one compression ratio each): what a piece of a
        request ready in ``layers`` of them counts (docs/protocol.md, LAYERS)."""
        return len(self.target.compression_ratios)

    @functools.cached_property
    def kv_layers(self) -> tuple[int, ...]:
        """The layer of each main KV buffer, in positional order: what selects a
        layer range's buffers (:func:`kvbeam.pools.plan.build_plan`'s ``layers``). Every
        builder here names a KV buffer ``<pool>.layer<N>.<part>``; a layout decoded from
        a peer is planned as the destination only, so it is never asked."""
        out = []
        for buf in self.kv.buffers:
            found = _LAYER_NAME.search(buf.name)
            if found is None:
                raise ValueError(f"KV buffer {buf.name!r} names no layer (<pool>.layer<N>.)")
            out.append(int(found.group(1)))
        return tuple(out)


#: A KV buffer's layer in its name (the builders below: ``<pool>.layer<N>.<part>``).
_LAYER_NAME = re.compile(r"\.layer(\d+)\.")


class _Builder:
    """Accumulates tensors and buffers for one pool (target or draft)."""

    def __init__(self, tensors: list[TensorLayout]) -> None:
        self.tensors = tensors

    def tensor(self, name: str, nbytes: int) -> int:
        self.tensors.append(TensorLayout(name, nbytes))
        return len(self.tensors) - 1


@dataclass
class _PoolBuffers:
    """The buffers of one pool, grouped the way the components need them."""

    c4_kv: list[BufferLayout]
    c4_indexer: list[BufferLayout]
    c128_kv: list[BufferLayout]
    swa_pages: list[BufferLayout]
    swa_ring: list[BufferLayout]
    c4_states: list[BufferLayout]
    c4_indexer_states: list[BufferLayout]
    c128_states: list[BufferLayout]


def _build_pool(pool: str, spec: PoolSpec, b: _Builder) -> _PoolBuffers:
    out = _PoolBuffers([], [], [], [], [], [], [], [])
    row = spec.kv_row_bytes
    for layer, ratio in enumerate(spec.compression_ratios):
        lname = f"{pool}.layer{layer}"
        compressed_rows = spec.full_pages * (spec.page_size // ratio) if ratio else 0
        kv_item = (spec.page_size // ratio) * row if ratio else 0
        if spec.unified_kv:
            t = b.tensor(f"{lname}.unified", (spec.swa_pages + compressed_rows) * row)
            out.swa_ring.append(BufferLayout(f"{lname}.swa_ring", t, 0, spec.swa_pages * row,
                                             row, IndexKind.SWA_RING_ROWS))
            kv_offset = spec.swa_pages * row  # the compressed rows follow the ring
        else:
            swa_item = spec.page_size * row
            swa_bytes = spec.num_req_slots * spec.swa_pages_per_request * swa_item
            t = b.tensor(f"{lname}.swa", swa_bytes)
            out.swa_pages.append(BufferLayout(f"{lname}.swa", t, 0, swa_bytes, swa_item,
                                              IndexKind.SWA_PAGES))
            if ratio:
                t = b.tensor(f"{lname}.c{ratio}_kv", compressed_rows * row)
            kv_offset = 0
        if ratio:
            kv_buf = BufferLayout(f"{lname}.c{ratio}_kv", t, kv_offset, compressed_rows * row,
                                  kv_item, IndexKind.KV_PAGES)
        if ratio == 4:
            out.c4_kv.append(kv_buf)
            irows = spec.full_pages * (spec.page_size // 4)
            irow = spec.indexer_row_bytes
            t = b.tensor(f"{lname}.c4_indexer", irows * irow)
            out.c4_indexer.append(BufferLayout(f"{lname}.c4_indexer", t, 0, irows * irow,
                                               (spec.page_size // 4) * irow, IndexKind.KV_PAGES))
            ring = spec.c4_ring_size
            for kind, width, dest in (("c4_state", spec.head_dim, out.c4_states),
                                      ("c4_indexer_state", spec.indexer_head_dim,
                                       out.c4_indexer_states)):
                srow = 2 * width * STATE_ELEMENT_SIZE  # value and score halves
                nbytes = spec.num_req_slots * ring * srow
                t = b.tensor(f"{lname}.{kind}", nbytes)
                dest.append(BufferLayout(f"{lname}.{kind}", t, 0, nbytes, ring * srow,
                                         IndexKind.REQ_SLOT))
        elif ratio == 128:
            out.c128_kv.append(kv_buf)
            # Online C128 keeps (max, sum, kv) per request; offline a ring of (kv, score).
            srow = (3 if spec.online_c128 else 2) * spec.head_dim * STATE_ELEMENT_SIZE
            rows = spec.num_req_slots * spec.c128_ring_size
            item = srow if spec.online_c128 else 128 * srow
            t = b.tensor(f"{lname}.c128_state", rows * srow)
            out.c128_states.append(BufferLayout(f"{lname}.c128_state", t, 0, rows * srow, item,
                                                IndexKind.C128_STATE))
    return out


def _paged_layout(config: SideConfig, b: _Builder) -> SideLayout:
    """A paged pool: one allocation and one ``KV_PAGES`` buffer of blocks per layer."""
    spec = config.target
    item, blocks = block_bytes(spec), num_blocks(spec)
    bufs = []
    for layer in range(len(spec.compression_ratios)):
        name = f"target.layer{layer}.kv"
        t = b.tensor(name, blocks * item)
        bufs.append(BufferLayout(name, t, 0, blocks * item, item, IndexKind.KV_PAGES))
    return SideLayout(model=config.model, target=PoolGeometry.of(spec), draft=None,
                      tensors=tuple(b.tensors), kv=ComponentLayout("kv", "target", None,
                                                                   tuple(bufs)), states=())


def _sglang_mha_layout(config: SideConfig, b: _Builder) -> SideLayout:
    """sglang's MHA pool: K of every layer, then V of every layer (``KV_PAGES``, one
    item a page), and the AUX component: one buffer per metadata field, one row
    (``REQ_SLOT``) per request."""
    spec = config.target
    item, pages = page_bytes(spec), spec.max_pages_per_req
    bufs = []
    for part in ("k", "v"):
        for layer in range(len(spec.compression_ratios)):
            name = f"target.layer{layer}.{part}"
            t = b.tensor(name, pages * item)
            bufs.append(BufferLayout(name, t, 0, pages * item, item, IndexKind.KV_PAGES))
    aux = []
    for i, row in enumerate(spec.aux_item_lens):
        name = f"target.aux{i}"
        t = b.tensor(name, spec.aux_rows * row)
        aux.append(BufferLayout(name, t, 0, spec.aux_rows * row, row, IndexKind.REQ_SLOT))
    return SideLayout(model=config.model, target=PoolGeometry.of(spec), draft=None,
                      tensors=tuple(b.tensors),
                      kv=ComponentLayout("kv", "target", None, tuple(bufs)),
                      states=(ComponentLayout("target.aux", "target", StateType.AUX,
                                              tuple(aux)),))


def build_side_layout(config: SideConfig) -> SideLayout:
    """Lay out a side's target and draft pools and its positional components.

    The layout is built even when target and draft disagree; the checks in
    :mod:`kvbeam.pools.checks` decide whether it may be used.
    """
    tensors: list[TensorLayout] = []
    builder = _Builder(tensors)
    if config.target.kind == "paged":
        return _paged_layout(config, builder)
    if config.target.kind == "sglang_mha":
        return _sglang_mha_layout(config, builder)
    tgt = _build_pool("target", config.target, builder)
    kv = ComponentLayout("kv", "target", None, (*tgt.c4_kv, *tgt.c4_indexer, *tgt.c128_kv))
    states: list[ComponentLayout] = [
        ComponentLayout("target.swa", "target", StateType.SWA,
                        (*tgt.swa_pages, *tgt.c4_states, *tgt.c4_indexer_states)),
    ]
    if config.target.unified_kv:
        states.append(ComponentLayout("target.swa_ring", "target", StateType.SWA_RING,
                                      tuple(tgt.swa_ring)))
    if tgt.c128_states:
        states.append(ComponentLayout("target.c128_state", "target", StateType.C128_STATE,
                                      tuple(tgt.c128_states)))
    draft_geometry = None
    if config.draft is not None:
        drf = _build_pool("draft", config.draft, builder)
        draft_geometry = PoolGeometry.of(config.draft)
        # The draft ships as its own component, last, so the target's heterogeneous
        # SWA component keeps its layout whether or not speculation is on.
        if config.draft.unified_kv:
            states.append(ComponentLayout("draft.swa_ring", "draft", StateType.SWA_RING,
                                          tuple(drf.swa_ring)))
        else:
            states.append(ComponentLayout("draft.swa", "draft", StateType.SWA,
                                          tuple(drf.swa_pages)))
    return SideLayout(
        model=config.model,
        target=PoolGeometry.of(config.target),
        draft=draft_geometry,
        tensors=tuple(tensors),
        kv=kv,
        states=tuple(states),
    )
