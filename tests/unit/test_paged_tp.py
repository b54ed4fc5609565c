"""Paged pools at different tensor-parallel places: head windows, plans, digests, checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbeam.errors import ConfigError, PlanError, PoolCompatibilityError
from kvbeam.pools.checks import check_sides, compare_sides
from kvbeam.pools.digest import request_digests
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.paged import block_bytes, head_window, paged_side_config, paged_spec
from kvbeam.pools.plan import build_plan, side_windows
from kvbeam.pools.spec import PoolSpec, SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.proto.attach_codec import config_to_mapping
from kvbeam.proto.layout_codec import layout_from_proto, layout_to_proto

TOTAL_HEADS = 4
BASE = dict(num_layers=2, block_size=4, head_size=2, dtype="float32", inner_layout="LBHNC",
            num_blocks=8)
PER_HEAD = 2 * 4 * 2 * 4  # K and V, block_size tokens, head_size float32 elements


def side(tp_size: int = 1, tp_rank: int = 0, total: int = TOTAL_HEADS, **over: object
         ) -> SideConfig:
    spec = paged_spec(**{**BASE, "num_kv_heads": total // tp_size, "tp_rank": tp_rank,  # type: ignore[arg-type]
                         "tp_size": tp_size, **over})
    return paged_side_config("tiny-llama", spec)


def layout(tp_size: int = 1, tp_rank: int = 0, total: int = TOTAL_HEADS, **over: object
           ) -> SideLayout:
    return build_side_layout(side(tp_size, tp_rank, total, **over))


# ---- the window arithmetic ------------------------------------------------------------
def test_head_window_of_each_decode_rank_in_a_tp1_block() -> None:
    item_p, item_d = 4 * PER_HEAD, 2 * PER_HEAD
    for rank in (0, 1):
        w = head_window(0, 4, item_p, rank, 2, item_d)
        assert (w.src_offset, w.dst_offset, w.width) == (rank * item_d, 0, item_d)
        assert not w.whole(item_p, item_d)
    assert head_window(1, 2, item_d, 1, 2, item_d).whole(item_d, item_d)


def test_head_window_refuses_other_bytes_per_head_and_disjoint_ranks() -> None:
    with pytest.raises(ValueError, match="bytes per head of a block differ: source 64, "
                                         "destination 32"):
        head_window(0, 4, 4 * 64, 0, 2, 2 * 32)
    with pytest.raises(ValueError, match=r"share no head: source heads \[0, 2\), "
                                         r"destination heads \[2, 4\)"):
        head_window(0, 2, 2 * 64, 1, 2, 2 * 64)
    with pytest.raises(ValueError, match="not whole heads"):
        head_window(0, 3, 100, 0, 1, 33)


# ---- the spec and the wire ------------------------------------------------------------
def test_spec_wire_and_attach_mapping_keep_the_tp_place() -> None:
    cfg = side(2, 1)
    assert (cfg.target.tp_rank, cfg.target.tp_size, cfg.target.num_kv_heads,
            cfg.target.total_kv_heads) == (1, 2, 2, 4)
    assert block_bytes(cfg.target) == 2 * PER_HEAD
    lay = build_side_layout(cfg)
    back = layout_from_proto(layout_to_proto(lay))
    assert back == lay and (back.target.tp_rank, back.target.tp_size) == (1, 2)
    assert SideConfig.from_mapping(config_to_mapping(cfg), cfg.source) == cfg


def test_a_peer_without_tp_fields_decodes_as_rank_0_of_1() -> None:
    msg = layout_to_proto(layout())
    msg.target.ClearField("tp_rank")
    msg.target.ClearField("tp_size")
    back = layout_from_proto(msg)
    assert (back.target.tp_rank, back.target.tp_size) == (0, 1)


@pytest.mark.parametrize(("over", "field"), [
    ({"tp_size": 0}, "tp_size"), ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"tp_rank": -1}, "tp_rank")])
def test_bad_tp_place_refused(over: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"paged pool\.{field}:"):
        paged_spec(**{**BASE, "num_kv_heads": 2, **over})  # type: ignore[arg-type]


def test_tp_belongs_to_the_paged_kind() -> None:
    with pytest.raises(ConfigError, match="tensor-parallel ranks belong to the paged kind"):
        PoolSpec(compression_ratios=(0,), tp_size=2).validate("t")


# ---- plans ----------------------------------------------------------------------------
def test_tp1_to_tp2_plans_one_window_block_per_page() -> None:
    src, dst = layout(1, 0), layout(2, 1)
    item_s, item_d = 4 * PER_HEAD, 2 * PER_HEAD
    s_addrs, d_addrs = [1000, 100_000], [500_000, 900_000]
    idx_s = {IndexKind.KV_PAGES: np.array([2, 3, 4], np.int64)}
    idx_d = {IndexKind.KV_PAGES: np.array([5, 6, 7], np.int64)}
    plan = build_plan(src, s_addrs, idx_s, dst, d_addrs, idx_d)
    assert plan.num_blocks == 6  # adjacent pages, but the windows are not adjacent
    want = [(s + p * item_s + item_d, d + q * item_d, item_d)
            for s, d in zip(s_addrs, d_addrs, strict=True)
            for p, q in zip([2, 3, 4], [5, 6, 7], strict=True)]
    got = list(zip(plan.blocks.src.tolist(), plan.blocks.dst.tolist(),
                   plan.blocks.lengths.tolist(), strict=True))
    assert got == want
    assert plan.total_bytes == 2 * 3 * item_d
    assert plan.items.tolist() == [3, 3]


def test_same_tp_place_still_coalesces_whole_items() -> None:
    for a, b in ((layout(1, 0), layout(1, 0)), (layout(2, 1), layout(2, 1))):
        idx = {IndexKind.KV_PAGES: np.array([2, 3, 4], np.int64)}
        plan = build_plan(a, [0, 10**6], idx, b, [0, 10**6], idx)
        item = a.flat_buffers[0].item_len
        assert plan.num_blocks == 2 and plan.blocks.lengths.tolist() == [3 * item] * 2


def test_window_plan_keeps_the_bounds_checks() -> None:
    src, dst = layout(1, 0), layout(2, 0)
    with pytest.raises(PlanError, match="destination index 8 out of range"):
        build_plan(src, [0, 0], {IndexKind.KV_PAGES: np.array([1], np.int64)}, dst, [0, 0],
                   {IndexKind.KV_PAGES: np.array([8], np.int64)})


def test_plan_refuses_pools_sharing_no_head() -> None:
    with pytest.raises(PlanError, match="share no head"):
        idx = {IndexKind.KV_PAGES: np.array([1], np.int64)}
        build_plan(layout(2, 0), [0, 0], idx, layout(2, 1), [0, 0], idx)


def _apply(plan_src: np.ndarray, plan_dst: np.ndarray, src: SideLayout, dst: SideLayout,
           pages_s: list[int], pages_d: list[int]) -> None:
    """Do a plan's writes between two byte arrays holding each side's buffers end to end."""
    s_addrs = [i * b.nbytes for i, b in enumerate(src.flat_buffers)]
    d_addrs = [i * b.nbytes for i, b in enumerate(dst.flat_buffers)]
    plan = build_plan(src, s_addrs, {IndexKind.KV_PAGES: np.array(pages_s, np.int64)}, dst,
                      d_addrs, {IndexKind.KV_PAGES: np.array(pages_d, np.int64)})
    for s, d, n in zip(plan.blocks.src.tolist(), plan.blocks.dst.tolist(),
                       plan.blocks.lengths.tolist(), strict=True):
        plan_dst[d:d + n] = plan_src[s:s + n]


def test_each_decode_rank_gets_exactly_its_heads() -> None:
    src = layout(1, 0)
    memory = np.random.default_rng(0).integers(0, 255, src.total_bytes, dtype=np.uint8)
    pages_s, pages_d = [1, 2, 5], [0, 3, 4]
    item_s = src.flat_buffers[0].item_len
    for rank in (0, 1):
        dst = layout(2, rank)
        landed = np.zeros(dst.total_bytes, np.uint8)
        _apply(memory, landed, src, dst, pages_s, pages_d)
        item_d = dst.flat_buffers[0].item_len
        for layer, (sb, db) in enumerate(zip(src.flat_buffers, dst.flat_buffers, strict=True)):
            for p, q in zip(pages_s, pages_d, strict=True):
                s0 = layer * sb.nbytes + p * item_s + rank * item_d
                d0 = layer * db.nbytes + q * item_d
                assert (landed[d0:d0 + item_d] == memory[s0:s0 + item_d]).all()
        untouched = set(range(8)) - set(pages_d)
        for layer, db in enumerate(dst.flat_buffers):
            for q in untouched:
                d0 = layer * db.nbytes + q * item_d
                assert not landed[d0:d0 + item_d].any()


# ---- digests --------------------------------------------------------------------------
class _Side:
    """The part of AllocatedSide the digests read: the layout and each buffer's bytes."""

    def __init__(self, lay: SideLayout, memory: np.ndarray) -> None:
        self.layout = lay
        self._memory = memory

    def buffer_array(self, buf: object) -> np.ndarray:
        i = self.layout.flat_buffers.index(buf)
        b = self.layout.flat_buffers[i]
        return self._memory[i * b.nbytes:(i + 1) * b.nbytes]


def test_source_digests_of_the_window_equal_decodes_of_what_landed() -> None:
    src, dst = layout(1, 0), layout(2, 1)
    memory = np.random.default_rng(1).integers(0, 255, src.total_bytes, dtype=np.uint8)
    landed = np.zeros(dst.total_bytes, np.uint8)
    pages_s, pages_d = [4, 1, 2], [0, 6, 7]
    _apply(memory, landed, src, dst, pages_s, pages_d)
    windows = side_windows(src, dst, source=True)
    item_d = dst.flat_buffers[0].item_len
    assert windows == ((item_d, item_d),) * 2
    # Decode's window is its whole block: its digests (of whole items) cover what landed.
    assert side_windows(dst, src, source=False) == ((0, item_d),) * 2
    ours = request_digests(_Side(src, memory), {IndexKind.KV_PAGES: np.array(pages_s)},  # type: ignore[arg-type]
                           windows=windows)
    theirs = request_digests(_Side(dst, landed), {IndexKind.KV_PAGES: np.array(pages_d)})  # type: ignore[arg-type]
    assert ours == theirs
    whole = request_digests(_Side(src, memory), {IndexKind.KV_PAGES: np.array(pages_s)})  # type: ignore[arg-type]
    assert whole != theirs  # the whole block is not what moved


# ---- the handshake's checks -----------------------------------------------------------
@pytest.mark.parametrize(("prefill", "decode"), [((1, 0), (2, 0)), ((1, 0), (2, 1)),
                                                 ((1, 0), (4, 3)), ((2, 1), (4, 2)),
                                                 ((2, 1), (4, 3)), ((2, 1), (2, 1))])
def test_prefill_heads_containing_decodes_are_accepted(prefill: tuple[int, int],
                                                       decode: tuple[int, int]) -> None:
    check_sides(layout(*prefill), layout(*decode))


def _refusal(prefill: SideLayout, decode: SideLayout, field: str) -> str:
    with pytest.raises(PoolCompatibilityError) as err:
        check_sides(prefill, decode)
    named = [d for d in err.value.differences if d.field == field]
    assert len(named) == 1, err.value.differences
    assert named[0].side == "prefill/decode"
    return named[0].message


def test_prefill_tp_above_decode_tp_is_refused_naming_both() -> None:
    msg = _refusal(layout(2, 0), layout(1, 0), "tp_size")
    assert "prefill above decode" in msg and "prefill=2, decode=1" in msg


def test_decode_tp_not_a_multiple_is_refused() -> None:
    msg = _refusal(layout(2, 0, total=6), layout(3, 0, total=6), "tp_size")
    assert "multiple of prefill's" in msg and "prefill=2, decode=3" in msg


def test_other_total_heads_are_refused() -> None:
    msg = _refusal(layout(1, 0), layout(2, 0, total=2), "total_kv_heads")
    assert "prefill=4x1=4, decode=1x2=2" in msg


def test_non_heads_outermost_layout_with_other_tp_is_refused_naming_it() -> None:
    p, d = layout(1, 0, inner_layout="LBNHC"), layout(2, 0, inner_layout="LBNHC")
    msg = _refusal(p, d, "inner_layout")
    assert "KV heads outermost (LBHNC)" in msg and "prefill=LBNHC, decode=LBNHC" in msg
    # Same TP: the layout is the engines' business, as before.
    check_sides(layout(2, 1, inner_layout="LBNHC"), layout(2, 1, inner_layout="LBNHC"))


def test_decode_heads_outside_prefills_are_refused() -> None:
    msg = _refusal(layout(2, 0), layout(2, 1), "tp_rank")
    assert ("prefill=rank 0 of 2, heads [0, 2), decode=rank 1 of 2, heads [2, 4)" in msg
            and "from prefill rank 1" in msg)
    _refusal(layout(2, 0), layout(4, 3), "tp_rank")


def test_per_head_bytes_compared_instead_of_item_length() -> None:
    diffs = compare_sides(layout(1, 0), layout(2, 0))
    assert diffs == []
    diffs = compare_sides(layout(1, 0), layout(2, 0, head_size=4))
    assert {d.field for d in diffs} >= {"head_size", "components[0].buffers[0].item_len"}


def test_same_place_other_heads_still_names_num_kv_heads() -> None:
    p = layout(1, 0)
    d = build_side_layout(paged_side_config("tiny-llama", dataclasses.replace(
        side(1, 0).target, num_kv_heads=2)))
    assert {x.field for x in compare_sides(p, d)} >= {"num_kv_heads"}
