"""Paged pools at different tensor-parallel places through a real gRPC handshake.

A prefill rank and a decode rank handshake when prefill's heads contain decode's (same
total heads, LBHNC, prefill TP <= decode TP and dividing it); every other combination
is refused on BOTH sides (the server's rejection trailer and the client's
PoolCompatibilityError) naming the field and both values, whichever side serves.
"""

from __future__ import annotations

import grpc
import pytest

from kvbeam.errors import PoolCompatibilityError
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.rejection_codec import Reason
from kvbeam.proto.side import Role, side_to_proto
from kvbeam.server.peers.client import handshake
from tests.control_helpers import raw_handshake, running, side

SERVERS = [Role.DECODE, Role.PREFILL]


def pool(tp_size: int, tp_rank: int, *, total: int = 4, inner_layout: str = "LBHNC"
         ) -> SideConfig:
    return paged_side_config("tiny-llama", paged_spec(
        num_layers=2, block_size=16, num_kv_heads=total // tp_size, head_size=64,
        dtype="bfloat16", inner_layout=inner_layout, num_blocks=64, tp_rank=tp_rank,
        tp_size=tp_size))


@pytest.mark.parametrize("server_role", SERVERS, ids=lambda r: f"{r.value}-serves")
@pytest.mark.parametrize(("p", "d"), [((1, 0), (2, 0)), ((1, 0), (2, 1)), ((2, 1), (4, 3))],
                         ids=["tp1-to-rank0-of-2", "tp1-to-rank1-of-2", "rank1-of-2-to-rank3-of-4"])
def test_prefill_rank_holding_decodes_heads_is_accepted(p: tuple[int, int], d: tuple[int, int],
                                                        server_role: Role) -> None:
    ps, ds = side(Role.PREFILL, pool(*p)), side(Role.DECODE, pool(*d))
    server_side, client_side = (ds, ps) if server_role is Role.DECODE else (ps, ds)
    with running(server_side, startup_check=True) as server:
        peer = handshake(client_side, server.address)
        assert peer.instance_id == server_side.instance_id
        assert (peer.layout.target.tp_rank, peer.layout.target.tp_size) == (
            server_side.layout.target.tp_rank, server_side.layout.target.tp_size)


REFUSED = [
    ("prefill-tp-above-decode", pool(2, 0), pool(1, 0), "tp_size",
     ("prefill above decode", "prefill=2, decode=1")),
    ("decode-tp-not-a-multiple", pool(2, 0, total=6), pool(3, 0, total=6), "tp_size",
     ("multiple of prefill's", "prefill=2, decode=3")),
    ("not-heads-outermost", pool(1, 0, inner_layout="NHD"), pool(2, 1, inner_layout="NHD"),
     "inner_layout", ("KV heads outermost (LBHNC)", "prefill=NHD, decode=NHD")),
    ("other-total-heads", pool(1, 0), pool(2, 0, total=2), "total_kv_heads",
     ("prefill=4x1=4, decode=1x2=2",)),
    ("decode-heads-elsewhere", pool(2, 0), pool(2, 1), "tp_rank",
     ("prefill=rank 0 of 2, heads [0, 2), decode=rank 1 of 2, heads [2, 4)",)),
]


@pytest.mark.parametrize("server_role", SERVERS, ids=lambda r: f"{r.value}-serves")
@pytest.mark.parametrize(("prefill_cfg", "decode_cfg", "field", "texts"),
                         [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_unsupported_tp_pairs_are_refused_on_both_sides(
        prefill_cfg: SideConfig, decode_cfg: SideConfig, field: str, texts: tuple[str, ...],
        server_role: Role) -> None:
    ps, ds = side(Role.PREFILL, prefill_cfg), side(Role.DECODE, decode_cfg)
    server_side, client_side = (ds, ps) if server_role is Role.DECODE else (ps, ds)
    with running(server_side, startup_check=True) as server:
        code, _, rejection, details = raw_handshake(
            server.address, pb.HandshakeRequest(side=side_to_proto(client_side)))
        assert code is grpc.StatusCode.FAILED_PRECONDITION, details
        assert rejection is not None and rejection.reason == Reason.REJECT_REASON_INCOMPATIBLE_POOLS
        named = [x for x in rejection.differences if x.field == field]
        assert len(named) == 1, rejection.differences
        assert named[0].side == "prefill/decode"
        assert all(t in named[0].message for t in texts), named[0].message
        with pytest.raises(PoolCompatibilityError) as info:
            handshake(client_side, server.address)
        assert client_side.instance_id not in server.peers
    assert info.value.differences == rejection.differences
    assert all(t in str(info.value) for t in texts), str(info.value)
