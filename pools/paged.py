"""The generic paged pool kind: per-layer K/V blocks of a full-attention model (vLLM).

A paged pool has one buffer per layer, cut in blocks; one block (one item of the
``KV_PAGES`` index kind) holds ``block_size`` tokens of K and V for every KV head,
in the order the engine's ``inner_layout`` names (vLLM CPU: ``LBHNC``), which kvbeam
never looks inside: it moves whole blocks, so both sides must use the same one (the
handshake compares it). An engine's block ids are the request's ``KV_PAGES`` list.

The pool is a :class:`~kvbeam.pools.spec.PoolSpec` of kind ``paged``, so a side
config, the attach message and the daemon's index checks carry it as they carry a
DSV4 pool: ``compression_ratios`` has one 0 per layer, ``page_size`` is the block
size, ``head_dim`` the head size, ``max_context_len / page_size`` the blocks of a layer
(any request may use any of them: the engine always names its blocks) and
``num_req_slots`` the transfers in flight at once.

Tensor parallelism: each TP rank of an engine attaches its own pool (``tp_rank`` of
``tp_size``, ``num_kv_heads`` the rank's own heads: rank r holds the model's heads
``[r * num_kv_heads, (r + 1) * num_kv_heads)``). In a block layout whose heads are the
outermost dimension of a block (:data:`HEADS_OUTERMOST_LAYOUTS`), the heads of a decode
rank are one contiguous byte range of each prefill block that holds them: the
:class:`HeadWindow`. kvbeam still never looks inside a head.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbeam.pools.spec import PoolSpec, SideConfig

#: Halves of a block: K and V.
KV_PARTS = 2


def paged_spec(*, num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
               dtype: str, inner_layout: str, num_blocks: int,
               max_inflight: int = 64, tp_rank: int = 0, tp_size: int = 1) -> PoolSpec:
    """A validated paged pool spec of ``num_blocks`` blocks per layer, ``max_inflight``
    requests moving at once; ``num_kv_heads`` are the heads of TP rank ``tp_rank`` of
    ``tp_size`` (the heads this pool holds)."""
    spec = PoolSpec(compression_ratios=(0,) * num_layers, page_size=block_size,
                    head_dim=head_size, num_kv_heads=num_kv_heads, dtype=dtype,
                    kind="paged", inner_layout=inner_layout, num_req_slots=max_inflight,
                    max_context_len=num_blocks * block_size, tp_rank=tp_rank,
                    tp_size=tp_size)
    spec.validate("paged pool")
    return spec


def paged_side_config(model: str, spec: PoolSpec) -> SideConfig:
    """The side config of an engine whose pool is the paged ``spec``."""
    return SideConfig(model=model, target=spec)


def block_bytes(spec: PoolSpec) -> int:
    """Bytes of one block of one layer: K and V of every head for ``page_size`` tokens."""
    return KV_PARTS * spec.page_size * spec.num_kv_heads * spec.head_dim * spec.element_size


def num_blocks(spec: PoolSpec) -> int:
    """Blocks per layer."""
    return spec.max_pages_per_req


#: The paged geometry fields the handshake compares, by the name users know them by.
#: (label, PoolGeometry attribute). Capacity (blocks) may differ between sides.
PAGED_FIELDS = (
    ("num_layers", "layers", "compression_ratios"),
    ("block_size", "block size", "page_size"),
    ("num_kv_heads", "KV heads", "num_kv_heads"),
    ("head_size", "head size", "head_dim"),
    ("dtype", "dtype", "dtype"),
    ("inner_layout", "block inner layout", "inner_layout"),
)



#: Block inner layouts whose KV heads are a block's outermost dimension, so the heads of
#: one TP rank are one contiguous byte range of every block (vLLM CPU's
#: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per layer). Only these pair
#: pools of different tensor-parallel sizes.
HEADS_OUTERMOST_LAYOUTS = frozenset({"LBHNC"})


def rank_heads(tp_rank: int, num_kv_heads: int) -> tuple[int, int]:
    """The model heads ``[first, end)`` that TP rank ``tp_rank`` holds, ``num_kv_heads`` each."""
    return tp_rank * num_kv_heads, (tp_rank + 1) * num_kv_heads


@dataclass(frozen=True)
class HeadWindow:
    """The heads two paged pools of different TP places share, as one block's byte range.

    ``src_offset``/``dst_offset`` are byte offsets inside one item (block) of each side,
    ``width`` the bytes from there: source bytes ``[item_s * page + src_offset, + width)``
    move to destination bytes ``[item_d * page + dst_offset, + width)``.
    """

    src_offset: int
    dst_offset: int
    width: int

    def whole(self, src_item: int, dst_item: int) -> bool:
        """True when the window is the whole item on both sides (pages coalesce)."""
        return (self.src_offset == 0 and self.dst_offset == 0
                and self.width == src_item == dst_item)


def head_window(src_rank: int, src_heads: int, src_item: int, dst_rank: int, dst_heads: int,
                dst_item: int) -> HeadWindow:
    """The byte window of the heads a source rank's block and a destination rank's share.

    Both items must hold the same bytes per head (``item / heads``), and the ranks must
    share at least one head.

    Raises:
        ValueError: the bytes per head differ, an item is not whole heads, or the ranks
            share no head (each naming the values).
    """
    if src_item % src_heads or dst_item % dst_heads:
        raise ValueError(f"a block is not whole heads: source {src_item} bytes for "
                         f"{src_heads} heads, destination {dst_item} bytes for {dst_heads}")
    per_head = src_item // src_heads
    if dst_item // dst_heads != per_head:
        raise ValueError(f"bytes per head of a block differ: source {per_head}, destination "
                         f"{dst_item // dst_heads}")
    s_lo, s_hi = rank_heads(src_rank, src_heads)
    d_lo, d_hi = rank_heads(dst_rank, dst_heads)
    lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
    if lo >= hi:
        raise ValueError(f"the ranks share no head: source heads [{s_lo}, {s_hi}), "
                         f"destination heads [{d_lo}, {d_hi})")
    return HeadWindow((lo - s_lo) * per_head, (lo - d_lo) * per_head, (hi - lo) * per_head)
