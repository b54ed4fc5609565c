"""Compatibility checks: target vs draft within one side, and prefill vs decode.

The target/draft checks are sglang's (``setup_state_kv_args``), with the same
wording so users can search for it, plus the values. They run on layouts (pure
data), so a side checks its own pools at start-up and its peer's at the handshake.
Every function collects ALL differences; nothing stops at the first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbeam.errors import Difference, PoolCompatibilityError
from kvbeam.pools.layout import PoolGeometry, SideLayout
from kvbeam.pools.paged import HEADS_OUTERMOST_LAYOUTS, PAGED_FIELDS, rank_heads

SWA_ONLY = "DSV4 draft state transfer expects SWA-only NextN layers"
SAME_UNIFIED = "DSV4 target and draft pools must use the same unified-KV mode"
SAME_RING = "DSV4 target and draft pools must share SWA ring geometry"
SAME_MAPPING = "DSV4 target and draft pools must share the SWA index mapping"
SAME_PAGED = "DSV4 target and draft pools must share paged SWA geometry"


def _fmt(value: object) -> str:
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return "[" + ", ".join(map(str, value)) + "]" if value else "[]"
    return str(value)


def target_draft_differences(layout: SideLayout, side: str) -> list[Difference]:
    """sglang's target/draft checks on one side's layout; empty when compatible or no draft."""
    t, d = layout.target, layout.draft
    if d is None:
        return []
    out: list[Difference] = []

    def add(field: str, text: str, tv: object, dv: object, detail: str | None = None) -> None:
        values = (("target", _fmt(tv)), ("draft", _fmt(dv)))
        body = detail or f"target={_fmt(tv)}, draft={_fmt(dv)}"
        out.append(Difference(field, side, values, f"{text}: {body} ({side} side)"))

    if not d.compression_ratios or any(r != 0 for r in d.compression_ratios):
        out.append(Difference(
            "draft.compression_ratios", side,
            (("draft", _fmt(d.compression_ratios)), ("expected", "all 0")),
            f"{SWA_ONLY}: draft compression_ratios={_fmt(d.compression_ratios)} "
            f"(must be non-empty and all 0) ({side} side)",
        ))
    if t.unified_kv != d.unified_kv:
        add("unified_kv", SAME_UNIFIED, t.unified_kv, d.unified_kv)
    elif t.unified_kv:
        t_ring = (t.sliding_window, t.swa_ring_size, t.swa_pages)
        d_ring = (d.sliding_window, d.swa_ring_size, d.swa_pages)
        if t_ring != d_ring:
            add("swa_ring_geometry", SAME_RING, t_ring, d_ring,
                f"target={t_ring}, draft={d_ring} as (window, ring_size, pages)")
    else:
        if t.swa_index_mapping != d.swa_index_mapping:
            add("swa_index_mapping", SAME_MAPPING, t.swa_index_mapping, d.swa_index_mapping)
        tg = (t.page_size, t.sliding_window)
        dg = (d.page_size, d.sliding_window)
        if tg != dg:
            add("paged_swa_geometry", SAME_PAGED, tg, dg,
                f"target={tg}, draft={dg} as (page_size, window)")
    return out


def check_target_draft(layout: SideLayout, side: str) -> None:
    """Raise :class:`PoolCompatibilityError` when one side's target and draft pools disagree.

    The message starts with sglang's text for the first problem found and lists all.
    """
    diffs = target_draft_differences(layout, side)
    if diffs:
        raise PoolCompatibilityError("; ".join(d.message for d in diffs), diffs)


@dataclass(frozen=True)
class _Field:
    name: str
    label: str
    get: Callable[[PoolGeometry], object]


# Fields that change what a byte means. Capacities (num_req_slots, swa_pages,
# max_context_len) are per side and may differ: each side addresses its own slots.
_GEOMETRY_FIELDS = (
    _Field("unified_kv", "unified-KV mode", lambda g: g.unified_kv),
    _Field("sliding_window", "sliding window", lambda g: g.sliding_window),
    _Field("swa_ring_size", "SWA ring size", lambda g: g.swa_ring_size),
    _Field("swa_index_mapping", "SWA index mapping", lambda g: g.swa_index_mapping),
    _Field("page_size", "page size", lambda g: g.page_size),
    _Field("compression_ratios", "compression ratios", lambda g: g.compression_ratios),
    _Field("dtype", "dtype", lambda g: g.dtype),
    _Field("head_dim", "head dim", lambda g: g.head_dim),
    _Field("indexer_head_dim", "indexer head dim", lambda g: g.indexer_head_dim),
    _Field("c4_ring_size", "C4 state ring size", lambda g: g.c4_ring_size),
    _Field("c128_ring_size", "C128 state ring size", lambda g: g.c128_ring_size),
    _Field("online_c128", "online C128 mode", lambda g: g.online_c128),
)

CROSS = "prefill/decode"


def _cross(field: str, label: str, p: object, d: object) -> Difference:
    ps, ds = _fmt(p), _fmt(d)
    return Difference(field, CROSS, (("prefill", ps), ("decode", ds)),
                      f"prefill and decode pools differ in {label}: prefill={ps}, decode={ds}")


def compare_sides(prefill: SideLayout, decode: SideLayout) -> list[Difference]:
    """Every difference between two sides' layouts, each side's target/draft problems too."""
    out = target_draft_differences(prefill, "prefill") + target_draft_differences(decode, "decode")
    if prefill.model != decode.model:
        out.append(_cross("model", "model", prefill.model, decode.model))
    if prefill.target.kind != decode.target.kind or prefill.target.kind != "dsv4":
        out.extend(_paged_differences(prefill.target, decode.target))
        out.extend(_component_differences(prefill, decode,
                                          per_head=_tp_place_differs(prefill.target,
                                                                     decode.target)))
        return out
    pools = [("", prefill.target, decode.target)]
    if (prefill.draft is None) != (decode.draft is None):
        out.append(_cross("draft", "draft (NextN) pool presence",
                          "present" if prefill.draft else "absent",
                          "present" if decode.draft else "absent"))
    elif prefill.draft is not None and decode.draft is not None:
        pools.append(("draft.", prefill.draft, decode.draft))
    for prefix, pg, dg in pools:
        for f in _GEOMETRY_FIELDS:
            if f.get(pg) != f.get(dg):
                label = f"draft {f.label}" if prefix else f.label
                out.append(_cross(prefix + f.name, label, f.get(pg), f.get(dg)))
    out.extend(_component_differences(prefill, decode))
    return out


def _paged_differences(p: PoolGeometry, d: PoolGeometry) -> list[Difference]:
    """Pool kinds differ: that alone; both paged or sglang_mha: every paged field, by its
    own name (the sglang_mha aux rows are compared as the AUX component's buffers), and
    the pools' tensor-parallel places (:func:`_tp_differences`)."""
    if p.kind != d.kind:
        return [_cross("kind", "pool kind", p.kind, d.kind)]
    tp = _tp_place_differs(p, d)
    out: list[Difference] = []
    for name, label, attr in PAGED_FIELDS:
        if name == "num_kv_heads" and tp:
            continue  # each rank's own heads: the TP check compares the totals
        pv, dv = getattr(p, attr), getattr(d, attr)
        if name == "num_layers":
            pv, dv = len(pv), len(dv)
        if pv != dv:
            out.append(_cross(name, label, pv, dv))
    if tp:
        out.extend(_tp_differences(p, d))
    return out


def _tp_place_differs(p: PoolGeometry, d: PoolGeometry) -> bool:
    """Both pools paged, at different tensor-parallel places (size or rank)."""
    return p.kind == d.kind == "paged" and (p.tp_size, p.tp_rank) != (d.tp_size, d.tp_rank)


def _tp(g: PoolGeometry) -> str:
    lo, hi = rank_heads(g.tp_rank, g.num_kv_heads)
    return f"rank {g.tp_rank} of {g.tp_size}, heads [{lo}, {hi})"


def _tp_differences(p: PoolGeometry, d: PoolGeometry) -> list[Difference]:
    """What keeps a prefill rank's pool from writing a decode rank's heads.

    Accepted: the same total heads, KV heads outermost in a block (so decode's heads are
    one byte range of prefill's block), prefill TP <= decode TP with decode TP a multiple
    of it, and prefill's heads containing decode's. Prefill TP above decode TP is refused:
    one decode block would need writes from several prefill ranks (docs/pools.md).
    """
    out: list[Difference] = []
    p_total, d_total = p.num_kv_heads * p.tp_size, d.num_kv_heads * d.tp_size
    if p_total != d_total:
        out.append(_cross("total_kv_heads", "total KV heads (num_kv_heads x tp_size)",
                          f"{p.num_kv_heads}x{p.tp_size}={p_total}",
                          f"{d.num_kv_heads}x{d.tp_size}={d_total}"))
    if p.tp_size != d.tp_size:
        layouts = {p.inner_layout, d.inner_layout}
        if not layouts <= HEADS_OUTERMOST_LAYOUTS:
            out.append(_tp_refusal(
                "inner_layout", p.inner_layout, d.inner_layout,
                f"tensor-parallel sizes differ (prefill={p.tp_size}, decode={d.tp_size}), "
                "which needs a block layout with KV heads outermost "
                f"({', '.join(sorted(HEADS_OUTERMOST_LAYOUTS))}): block inner layout"))
        if p.tp_size > d.tp_size:
            out.append(_tp_refusal(
                "tp_size", p.tp_size, d.tp_size,
                "tensor-parallel size, prefill above decode (not supported: one decode "
                "block would need writes from several prefill ranks; run decode with at "
                "least prefill's TP):"))
        elif d.tp_size % p.tp_size:
            out.append(_tp_refusal(
                "tp_size", p.tp_size, d.tp_size,
                "tensor-parallel size (decode's must be a multiple of prefill's):"))
    if not out:
        p_lo, p_hi = rank_heads(p.tp_rank, p.num_kv_heads)
        d_lo, d_hi = rank_heads(d.tp_rank, d.num_kv_heads)
        if not p_lo <= d_lo < d_hi <= p_hi:
            out.append(_tp_refusal(
                "tp_rank", _tp(p), _tp(d),
                "tensor-parallel rank (prefill's heads must contain decode's: decode rank "
                f"{d.tp_rank} takes its heads from prefill rank "
                f"{d_lo // p.num_kv_heads}):"))
    return out


def _tp_refusal(field: str, p: object, d: object, what: str) -> Difference:
    """A tensor-parallel refusal: ``what`` says why, then both values as :func:`_cross`."""
    ps, ds = _fmt(p), _fmt(d)
    return Difference(field, CROSS, (("prefill", ps), ("decode", ds)),
                      f"prefill and decode pools differ in {what} prefill={ps}, decode={ds}")


def _component_differences(prefill: SideLayout, decode: SideLayout, *,
                           per_head: bool = False) -> list[Difference]:
    """Each component's buffers, side by side. ``per_head``: paged pools at different
    tensor-parallel places, whose KV blocks hold different heads; their bytes per head
    must match instead of their item lengths."""
    out: list[Difference] = []
    pc, dc = prefill.components, decode.components
    if len(pc) != len(dc):
        out.append(_cross("components.count", "component count", len(pc), len(dc)))
    for i, (a, b) in enumerate(zip(pc, dc, strict=False)):
        where = f"component {i} ({a.name})"
        at = a.state_type.value if a.state_type else "KV"
        bt = b.state_type.value if b.state_type else "KV"
        if at != bt:
            out.append(_cross(f"components[{i}].type", f"{where} type", at, bt))
            continue
        if len(a.buffers) != len(b.buffers):
            out.append(_cross(f"components[{i}].buffers", f"{where} buffer count",
                              len(a.buffers), len(b.buffers)))
            continue
        for j, (ba, bb) in enumerate(zip(a.buffers, b.buffers, strict=True)):
            if per_head and a.state_type is None:
                ph = _per_head(ba.item_len, prefill.target.num_kv_heads)
                dh = _per_head(bb.item_len, decode.target.num_kv_heads)
                if ph != dh:
                    out.append(_cross(f"components[{i}].buffers[{j}].item_len",
                                      f"{where} buffer {j} ({ba.name}) bytes per KV head",
                                      ph, dh))
            elif ba.item_len != bb.item_len:
                out.append(_cross(f"components[{i}].buffers[{j}].item_len",
                                  f"{where} buffer {j} ({ba.name}) item length",
                                  ba.item_len, bb.item_len))
            if ba.index_kind != bb.index_kind:
                out.append(_cross(f"components[{i}].buffers[{j}].index_kind",
                                  f"{where} buffer {j} ({ba.name}) index kind",
                                  ba.index_kind.value, bb.index_kind.value))
    return out


def _per_head(item_len: int, heads: int) -> str:
    """A block's bytes per head, or how it fails to be whole heads."""
    if item_len % heads:
        return f"{item_len} bytes for {heads} heads (not whole heads)"
    return str(item_len // heads)


def check_sides(prefill: SideLayout, decode: SideLayout) -> None:
    """Raise :class:`PoolCompatibilityError` listing every difference, or return."""
    diffs = compare_sides(prefill, decode)
    if diffs:
        raise PoolCompatibilityError(
            f"{len(diffs)} pool difference(s) between prefill and decode: "
            + "; ".join(d.message for d in diffs),
            diffs,
        )
