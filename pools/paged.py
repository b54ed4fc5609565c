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
"""

from __future__ import annotations

from kvbeam.pools.spec import PoolSpec, SideConfig

#: Halves of a block: K and V.
KV_PARTS = 2


def paged_spec(*, num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
               dtype: str, inner_layout: str, num_blocks: int,
               max_inflight: int = 64) -> PoolSpec:
    """A validated paged pool spec of ``num_blocks`` blocks per layer, ``max_inflight``
    requests moving at once."""
    spec = PoolSpec(compression_ratios=(0,) * num_layers, page_size=block_size,
                    head_dim=head_size, num_kv_heads=num_kv_heads, dtype=dtype,
                    kind="paged", inner_layout=inner_layout, num_req_slots=max_inflight,
                    max_context_len=num_blocks * block_size)
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

