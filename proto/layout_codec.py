"""SideLayout <-> ``kvbeam.v1.PoolMetadata``: what one side's pool bytes mean.

The decoder is structural and strict: every number must be in range, every enum
known, every buffer inside a tensor that exists, the KV component first. It does
NOT judge compatibility (target vs draft, or against our own pools): a peer whose
draft disagrees with its target must decode, so that
:func:`kvbeam.pools.checks.compare_sides` can report the difference with sglang's
wording.
"""

from __future__ import annotations

from kvbeam.errors import ProtocolError
from kvbeam.pools.layout import (
    BufferLayout,
    ComponentLayout,
    PoolGeometry,
    SideLayout,
    TensorLayout,
)
from kvbeam.pools.spec import POOL_KINDS, VALID_RATIOS
from kvbeam.pools.types import IndexKind, StateType
from kvbeam.proto.fields import MAX_BYTES, count, enum_value, int_in, text
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb

DTYPE_TO_PROTO: dict[str, pb.DType] = {
    "bfloat16": pb.DType.DTYPE_BFLOAT16,
    "float16": pb.DType.DTYPE_FLOAT16,
    "float32": pb.DType.DTYPE_FLOAT32,
    "float8_e4m3fn": pb.DType.DTYPE_FLOAT8_E4M3FN,
    "uint8": pb.DType.DTYPE_UINT8,
}
_DTYPE_FROM_PROTO = {int(v): k for k, v in DTYPE_TO_PROTO.items()}

#: Component type on the wire; ``None`` is the main KV component.
COMPONENT_TYPE_TO_PROTO: dict[StateType | None, pb.ComponentType] = {
    None: pb.ComponentType.COMPONENT_TYPE_KV,
    StateType.SWA: pb.ComponentType.COMPONENT_TYPE_SWA,
    StateType.SWA_RING: pb.ComponentType.COMPONENT_TYPE_SWA_RING,
    StateType.C128_STATE: pb.ComponentType.COMPONENT_TYPE_C128_STATE,
    StateType.AUX: pb.ComponentType.COMPONENT_TYPE_AUX,
}
_COMPONENT_TYPE_FROM_PROTO = {int(v): k for k, v in COMPONENT_TYPE_TO_PROTO.items()}

INDEX_KIND_TO_PROTO: dict[IndexKind, pb.IndexKind] = {
    IndexKind.KV_PAGES: pb.IndexKind.INDEX_KIND_KV_PAGES,
    IndexKind.SWA_PAGES: pb.IndexKind.INDEX_KIND_SWA_PAGES,
    IndexKind.SWA_RING_ROWS: pb.IndexKind.INDEX_KIND_SWA_RING_ROWS,
    IndexKind.REQ_SLOT: pb.IndexKind.INDEX_KIND_REQ_SLOT,
    IndexKind.C128_STATE: pb.IndexKind.INDEX_KIND_C128_STATE,
}
_INDEX_KIND_FROM_PROTO = {int(v): k for k, v in INDEX_KIND_TO_PROTO.items()}

POOL_TO_PROTO: dict[str, pb.PoolName] = {
    "target": pb.PoolName.POOL_NAME_TARGET,
    "draft": pb.PoolName.POOL_NAME_DRAFT,
}
_POOL_FROM_PROTO = {int(v): k for k, v in POOL_TO_PROTO.items()}

# Upper bounds of the geometry fields. Generous (a real DSV4 is ~10x-1000x below
# each) but finite, so a corrupt value is refused instead of being multiplied
# into a petabyte-sized plan later.
MAX_LAYERS = 1024
MAX_TOKENS = 1 << 31       # windows, ring rows, page size, context length
MAX_DIM = 1 << 20          # head dims
MAX_SLOTS = 1 << 24        # request slots
MAX_PAGES = 1 << 40        # SWA ring rows of a whole pool
MAX_RING = 1 << 20         # compression-state rings
MAX_COMPONENTS = 64
MAX_FINGERPRINT_LEN = 128
MAX_TP = 1 << 16           # tensor-parallel ranks of an instance


# ---- encoding ---------------------------------------------------------------
def geometry_to_proto(g: PoolGeometry, field: str = "geometry") -> pb.PoolGeometry:
    """Encode one pool's geometry."""
    dtype = DTYPE_TO_PROTO.get(g.dtype)
    if dtype is None:
        raise ProtocolError(f"{field}.dtype", f"no wire value for dtype {g.dtype!r}")
    return pb.PoolGeometry(
        compression_ratios=list(g.compression_ratios),
        unified_kv=g.unified_kv,
        sliding_window=g.sliding_window,
        swa_ring_size=g.swa_ring_size,
        swa_pages=g.swa_pages,
        page_size=g.page_size,
        head_dim=g.head_dim,
        indexer_head_dim=g.indexer_head_dim,
        dtype=dtype,
        num_draft_tokens=g.num_draft_tokens,
        online_c128=g.online_c128,
        c4_ring_size=g.c4_ring_size,
        c128_ring_size=g.c128_ring_size,
        swa_pages_per_req=g.swa_pages_per_req,
        num_req_slots=g.num_req_slots,
        max_context_len=g.max_context_len,
        swa_index_mapping=g.swa_index_mapping,
        kind=g.kind,
        num_kv_heads=g.num_kv_heads,
        inner_layout=g.inner_layout,
        tp_rank=g.tp_rank,
        tp_size=g.tp_size,
    )


def _component_to_proto(c: ComponentLayout) -> pb.Component:
    pool = POOL_TO_PROTO.get(c.pool)
    if pool is None:
        raise ProtocolError("metadata.components.pool",
                            f"component {c.name!r}: unknown pool {c.pool!r}")
    return pb.Component(
        name=c.name,
        pool=pool,
        type=COMPONENT_TYPE_TO_PROTO[c.state_type],
        buffers=[
            pb.Buffer(name=b.name, tensor=b.tensor, offset=b.offset, nbytes=b.nbytes,
                      item_len=b.item_len, index_kind=INDEX_KIND_TO_PROTO[b.index_kind])
            for b in c.buffers
        ],
    )


def layout_to_proto(layout: SideLayout) -> pb.PoolMetadata:
    """Encode a side's layout. Raises ProtocolError for a value the wire cannot carry."""
    try:
        msg = pb.PoolMetadata(
            model=layout.model,
            target=geometry_to_proto(layout.target, "metadata.target"),
            tensors=[pb.Tensor(name=t.name, nbytes=t.nbytes) for t in layout.tensors],
            components=[_component_to_proto(c) for c in layout.components],
        )
        if layout.draft is not None:
            msg.draft.CopyFrom(geometry_to_proto(layout.draft, "metadata.draft"))
    except (ValueError, TypeError) as exc:
        # protobuf refuses e.g. an int beyond int64; say so as a typed error.
        raise ProtocolError("metadata", f"cannot encode the layout: {exc}") from exc
    return msg


# ---- decoding ---------------------------------------------------------------
def geometry_from_proto(m: pb.PoolGeometry, field: str, *, require_layers: bool) -> PoolGeometry:
    """Decode one pool's geometry; ``require_layers`` refuses an empty ratio list (target)."""
    count(m.compression_ratios, f"{field}.compression_ratios",
          lo=1 if require_layers else 0, hi=MAX_LAYERS)
    for i, r in enumerate(m.compression_ratios):
        if r not in VALID_RATIOS:
            raise ProtocolError(f"{field}.compression_ratios[{i}]",
                                f"each ratio must be 0, 4 or 128 (got {r})")

    def pos(name: str, value: int, hi: int) -> int:
        return int_in(value, f"{field}.{name}", 1, hi)

    # tp_size 0 (unset): rank 0 of 1 (no tensor parallelism).
    tp_size = int_in(m.tp_size or 1, f"{field}.tp_size", 1, MAX_TP)
    tp_rank = int_in(m.tp_rank, f"{field}.tp_rank", 0, tp_size - 1)
    return PoolGeometry(
        compression_ratios=tuple(int(r) for r in m.compression_ratios),
        unified_kv=bool(m.unified_kv),
        sliding_window=pos("sliding_window", m.sliding_window, MAX_TOKENS),
        swa_ring_size=pos("swa_ring_size", m.swa_ring_size, MAX_TOKENS),
        swa_pages=pos("swa_pages", m.swa_pages, MAX_PAGES),
        page_size=pos("page_size", m.page_size, MAX_TOKENS),
        head_dim=pos("head_dim", m.head_dim, MAX_DIM),
        indexer_head_dim=pos("indexer_head_dim", m.indexer_head_dim, MAX_DIM),
        dtype=enum_value(m.dtype, _DTYPE_FROM_PROTO, f"{field}.dtype", "DType"),
        num_draft_tokens=int_in(m.num_draft_tokens, f"{field}.num_draft_tokens", 0, MAX_TOKENS),
        online_c128=bool(m.online_c128),
        c4_ring_size=pos("c4_ring_size", m.c4_ring_size, MAX_RING),
        c128_ring_size=pos("c128_ring_size", m.c128_ring_size, MAX_RING),
        swa_pages_per_req=pos("swa_pages_per_req", m.swa_pages_per_req, MAX_TOKENS),
        num_req_slots=pos("num_req_slots", m.num_req_slots, MAX_SLOTS),
        max_context_len=pos("max_context_len", m.max_context_len, MAX_TOKENS),
        swa_index_mapping=text(m.swa_index_mapping, f"{field}.swa_index_mapping",
                               max_len=MAX_FINGERPRINT_LEN),
        kind=_kind(m.kind, f"{field}.kind"),
        num_kv_heads=int_in(m.num_kv_heads or 1, f"{field}.num_kv_heads", 1, MAX_DIM),
        inner_layout=text(m.inner_layout, f"{field}.inner_layout", required=False,
                          max_len=MAX_FINGERPRINT_LEN),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def _kind(value: str, field: str) -> str:
    """The pool kind; unset means DSV4."""
    if not value:
        return "dsv4"
    if value not in POOL_KINDS:
        raise ProtocolError(field, f"unknown pool kind {value[:64]!r} "
                                   f"(known: {', '.join(POOL_KINDS)})")
    return value



def _buffer_from_proto(m: pb.Buffer, field: str,
                       tensors: tuple[TensorLayout, ...]) -> BufferLayout:
    name = text(m.name, f"{field}.name")
    if not tensors:
        raise ProtocolError(f"{field}.tensor",
                            f"refers to tensor {m.tensor} but metadata.tensors is empty")
    tensor = int_in(m.tensor, f"{field}.tensor", 0, len(tensors) - 1)
    offset = int_in(m.offset, f"{field}.offset", 0, MAX_BYTES)
    nbytes = int_in(m.nbytes, f"{field}.nbytes", 0, MAX_BYTES)
    item_len = int_in(m.item_len, f"{field}.item_len", 1, MAX_BYTES)
    kind = enum_value(m.index_kind, _INDEX_KIND_FROM_PROTO, f"{field}.index_kind", "IndexKind")
    limit = tensors[tensor].nbytes
    if offset + nbytes > limit:
        raise ProtocolError(
            field, f"bytes [{offset}, {offset + nbytes}) lie outside tensor {tensor} "
                   f"({tensors[tensor].name}, {limit} bytes)")
    return BufferLayout(name, tensor, offset, nbytes, item_len, kind)


def _component_from_proto(m: pb.Component, field: str, tensors: tuple[TensorLayout, ...],
                          has_draft: bool) -> ComponentLayout:
    name = text(m.name, f"{field}.name")
    pool = enum_value(m.pool, _POOL_FROM_PROTO, f"{field}.pool", "PoolName")
    if pool == "draft" and not has_draft:
        raise ProtocolError(f"{field}.pool",
                            "a draft component needs metadata.draft, which is absent")
    state_type = enum_value(m.type, _COMPONENT_TYPE_FROM_PROTO, f"{field}.type", "ComponentType")
    count(m.buffers, f"{field}.buffers")
    buffers = tuple(_buffer_from_proto(b, f"{field}.buffers[{j}]", tensors)
                    for j, b in enumerate(m.buffers))
    return ComponentLayout(name, pool, state_type, buffers)


def layout_from_proto(m: pb.PoolMetadata, field: str = "metadata") -> SideLayout:
    """Decode and structurally validate a side's pool metadata.

    Raises:
        ProtocolError: naming the first offending field.
    """
    model = text(m.model, f"{field}.model")
    if not m.HasField("target"):
        raise ProtocolError(f"{field}.target", "required field is missing")
    target = geometry_from_proto(m.target, f"{field}.target", require_layers=True)
    draft = (geometry_from_proto(m.draft, f"{field}.draft", require_layers=False)
             if m.HasField("draft") else None)
    count(m.tensors, f"{field}.tensors")
    tensors = tuple(
        TensorLayout(text(t.name, f"{field}.tensors[{i}].name"),
                     int_in(t.nbytes, f"{field}.tensors[{i}].nbytes", 0, MAX_BYTES))
        for i, t in enumerate(m.tensors)
    )
    count(m.components, f"{field}.components", lo=1, hi=MAX_COMPONENTS)
    components = [
        _component_from_proto(c, f"{field}.components[{i}]", tensors, draft is not None)
        for i, c in enumerate(m.components)
    ]
    # Positional order is part of the contract: the main KV component first, then
    # only state components (sglang's wire layout; SideLayout.components).
    kv, *states = components
    if kv.state_type is not None or kv.pool != "target":
        raise ProtocolError(f"{field}.components[0]",
                            "the first component must be the target pool's KV component")
    for i, c in enumerate(states, start=1):
        if c.state_type is None:
            raise ProtocolError(f"{field}.components[{i}].type",
                                "only the first component may be KV; later ones are states")
    return SideLayout(model=model, target=target, draft=draft, tensors=tensors,
                      kv=kv, states=tuple(states))
