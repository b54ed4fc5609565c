"""Every single-field mismatch is refused on BOTH sides of a real gRPC handshake.

For each case one side's config differs from a compatible pair in one field.
The server refuses with FAILED_PRECONDITION and a structured difference list
naming the field; the client raises PoolCompatibilityError with the same list.
Both server roles are exercised (prefill serving, decode serving), and
within-side (target vs draft) problems on either side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest

from kvbeam.errors import PoolCompatibilityError
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.rejection_codec import Reason
from kvbeam.proto.side import Role, side_to_proto
from kvbeam.server.peers.client import handshake
from tests.control_helpers import DECODE_SLOTS, config, raw_handshake, running, side, with_slots


def _draft(cfg: SideConfig, **changes: Any) -> SideConfig:
    assert cfg.draft is not None
    return replace(cfg, draft=replace(cfg.draft, **changes))


def _both(cfg: SideConfig, **changes: Any) -> SideConfig:
    return _draft(replace(cfg, target=replace(cfg.target, **changes)), **changes)


def _target(cfg: SideConfig, **changes: Any) -> SideConfig:
    return replace(cfg, target=replace(cfg.target, **changes))


UNIFIED = config()
PAGED = config(paged=True)
# Decode's bases have more request slots: a per-side capacity, never compared.
UNIFIED_D = with_slots(UNIFIED, DECODE_SLOTS)
PAGED_D = with_slots(PAGED, DECODE_SLOTS)

# (case, base config, change to one side) -> (field, whose field)
WITHIN: list[tuple[str, bool, dict[str, Any], str]] = [
    ("unified-kv", False, {"unified_kv": False}, "unified_kv"),
    ("window", False, {"sliding_window": 64}, "swa_ring_geometry"),
    ("ring-size", False, {"swa_ring_size": 140}, "swa_ring_geometry"),
    ("pages", False, {"num_req_slots": 2}, "swa_ring_geometry"),
    ("mapping-fingerprint", True, {"swa_pages_per_req": 3}, "swa_index_mapping"),
    ("paged-window", True, {"sliding_window": 64}, "paged_swa_geometry"),
    ("paged-page-size", True, {"page_size": 128}, "paged_swa_geometry"),
    ("draft-ratios", False, {"compression_ratios": (4,)}, "draft.compression_ratios"),
]


@dataclass(frozen=True)
class Cross:
    name: str
    prefill: SideConfig
    decode: SideConfig
    field: str


CROSS = [
    Cross("unified-kv", UNIFIED, PAGED_D, "unified_kv"),
    Cross("window", UNIFIED, _both(UNIFIED_D, sliding_window=64), "sliding_window"),
    Cross("ring-size", UNIFIED, _both(UNIFIED_D, swa_ring_size=140), "swa_ring_size"),
    Cross("mapping-fingerprint", PAGED, _both(PAGED_D, swa_pages_per_req=3),
          "swa_index_mapping"),
    Cross("page-size", UNIFIED, _both(UNIFIED_D, page_size=512), "page_size"),
    Cross("ratios", UNIFIED, _target(UNIFIED_D, compression_ratios=(0, 4, 4, 0)),
          "compression_ratios"),
    Cross("dtype", UNIFIED, _both(UNIFIED_D, dtype="float16"), "dtype"),
    Cross("item-length", UNIFIED, _both(UNIFIED_D, head_dim=32),
          "components[0].buffers[0].item_len"),
    Cross("indexer-head-dim", UNIFIED, _target(UNIFIED_D, indexer_head_dim=16),
          "indexer_head_dim"),
    Cross("component-count", UNIFIED, replace(UNIFIED_D, draft=None), "components.count"),
    Cross("draft-presence", UNIFIED, replace(UNIFIED_D, draft=None), "draft"),
    Cross("c4-ring", UNIFIED, _both(UNIFIED_D, num_draft_tokens=0), "c4_ring_size"),
    Cross("online-c128", UNIFIED, _target(UNIFIED_D, online_c128=True), "online_c128"),
    Cross("model", UNIFIED, replace(UNIFIED_D, model="dsv4-other"), "model"),
    Cross("draft-head-dim", UNIFIED, _draft(UNIFIED_D, head_dim=32), "draft.head_dim"),
    Cross("paged-page-size", PAGED, _both(PAGED_D, page_size=512), "page_size"),
]

SERVERS = [Role.DECODE, Role.PREFILL]


def _refused_on_both_sides(prefill_cfg: SideConfig, decode_cfg: SideConfig, server_role: Role,
                           field: str, whose: str) -> None:
    p = side(Role.PREFILL, prefill_cfg)
    d = side(Role.DECODE, decode_cfg)
    server_side, client_side = (d, p) if server_role is Role.DECODE else (p, d)
    # The server's own start-up check would stop a broken side; bypass it.
    with running(server_side, startup_check=False) as server:
        code, _, rejection, details = raw_handshake(
            server.address, pb.HandshakeRequest(side=side_to_proto(client_side)))
        assert code is grpc.StatusCode.FAILED_PRECONDITION, details
        assert rejection is not None
        assert rejection.reason == Reason.REJECT_REASON_INCOMPATIBLE_POOLS
        server_found = {(x.field, x.side) for x in rejection.differences}
        assert (field, whose) in server_found, sorted(server_found)
        with pytest.raises(PoolCompatibilityError) as info:
            handshake(client_side, server.address)
        assert client_side.instance_id not in server.peers
    client_found = {(x.field, x.side) for x in info.value.differences}
    assert (field, whose) in client_found
    assert info.value.differences == rejection.differences


@pytest.mark.parametrize("server_role", SERVERS, ids=lambda r: f"{r.value}-serves")
@pytest.mark.parametrize("bad", [Role.PREFILL, Role.DECODE], ids=lambda r: f"bad-{r.value}")
@pytest.mark.parametrize(("paged", "change", "field"), [(b, c, f) for _, b, c, f in WITHIN],
                         ids=[w[0] for w in WITHIN])
def test_within_side_mismatch(paged: bool, change: dict[str, Any], field: str,
                              bad: Role, server_role: Role) -> None:
    prefill_cfg, decode_cfg = (PAGED, PAGED_D) if paged else (UNIFIED, UNIFIED_D)
    if bad is Role.PREFILL:
        prefill_cfg = _draft(prefill_cfg, **change)
    else:
        decode_cfg = _draft(decode_cfg, **change)
    _refused_on_both_sides(prefill_cfg, decode_cfg, server_role, field, bad.value)


@pytest.mark.parametrize("server_role", SERVERS, ids=lambda r: f"{r.value}-serves")
@pytest.mark.parametrize("case", CROSS, ids=[c.name for c in CROSS])
def test_cross_side_mismatch(case: Cross, server_role: Role) -> None:
    _refused_on_both_sides(case.prefill, case.decode, server_role, case.field, "prefill/decode")


@pytest.mark.parametrize("server_role", SERVERS, ids=lambda r: f"{r.value}-serves")
@pytest.mark.parametrize("base", [UNIFIED, PAGED], ids=["unified", "paged"])
def test_capacities_may_differ(base: SideConfig, server_role: Role) -> None:
    # Request slots, hence swa_pages, are per-side capacities: not compared across sides.
    p = side(Role.PREFILL, base)
    d = side(Role.DECODE, with_slots(base, DECODE_SLOTS))  # 6 slots against 4
    assert p.layout.target.swa_pages != d.layout.target.swa_pages
    server_side, client_side = (d, p) if server_role is Role.DECODE else (p, d)
    with running(server_side, startup_check=True) as server:
        peer = handshake(client_side, server.address)
        assert peer.instance_id == server_side.instance_id
        assert client_side.instance_id in server.peers
