"""Two daemons over TCP moving engine-chosen (shuffled, fragmented) index lists.

Integrity is on (the default): decode's Success says its XXH3-128 of the items at
ITS lists, in list order, equals prefill's of the items at ITS lists, so element i
of prefill's list of a kind landed at element i of decode's, for every buffer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbeam.client import KvbeamClient
from kvbeam.errors import BadRequest, UnknownRequest
from kvbeam.pools.types import IndexKind
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.transfer_codec import indices_to_proto
from kvbeam.states import VERIFIED_PREFIX, TransferState
from tests.control_helpers import run_cli
from tests.daemon_helpers import DECODE_SLOTS, free_slots, pair
from tests.engine_lists import as_mapping, shipped_lists


def _move(p: KvbeamClient, d: KvbeamClient, rid: str, seq_len: int, seed: int, *,
          paged: bool, decode_draft: bool, prefill_draft: bool) -> None:
    s, s_draft = shipped_lists("prefill", paged, seq_len, seed, prefill_draft)
    dst, d_draft = shipped_lists("decode", paged, seq_len, seed + 1000, decode_draft)
    r = d.reserve(rid, seq_len, p.address, indices=as_mapping(dst, d_draft))
    assert r.slot == -1
    assert all(np.array_equal(r.indices[k], v) for k, v in dst.items())
    assert set(r.draft) == set(d_draft)
    p.send(rid, -1, seq_len, d.address, indices=as_mapping(s, s_draft))
    final = d.wait(rid, 60)
    assert final.state is TransferState.SUCCESS, str(final)
    assert final.detail.startswith(VERIFIED_PREFIX), final.detail
    assert p.wait(rid, 10).state is TransferState.SUCCESS
    d.release(rid)


@pytest.mark.parametrize("paged", [False, True], ids=["unified", "paged"])
def test_engine_lists_move_verified(paged: bool) -> None:
    with pair(paged=paged) as (_prefill, _decode, p, d):
        # Lengths ending on and off a page (256), the window and a C128 group.
        for i, (seq_len, dd, pd) in enumerate([(1000, False, False), (4096, True, False),
                                               (4097, False, True), (130, True, True)]):
            _move(p, d, f"eng-{i}", seq_len, 40 + i, paged=paged, decode_draft=dd,
                  prefill_draft=pd)
        # Slot-based and engine lists meet: a slot-based prefill, an engine decode.
        dst, _ = shipped_lists("decode", paged, 3000, 7)
        d.reserve("mixed", 3000, p.address, indices=as_mapping(dst))
        p.send("mixed", 2, 3000, d.address)
        assert d.wait("mixed", 60).detail.startswith(VERIFIED_PREFIX)
        d.release("mixed")
        assert free_slots(d) == DECODE_SLOTS


def test_bad_lists_are_refused_before_any_byte_moves(tmp_path: Path) -> None:
    with pair() as (_prefill, _decode, p, d):
        dst, _ = shipped_lists("decode", False, 1000, 1)
        bad = dict(dst)
        bad[IndexKind.KV_PAGES] = bad[IndexKind.KV_PAGES].copy()
        bad[IndexKind.KV_PAGES][2] = 10**7
        with pytest.raises(grpc.RpcError) as info:
            d.stub.Reserve(pb.ReserveRequest(request_id="bad-r", seq_len=1000,
                                             prefill_address=p.address,
                                             indices=indices_to_proto(bad)), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "decode: KV_PAGES index 10000000 at position 2 is out of range: the pool has " \
            "2048 pages (valid 0..2047)" in str(info.value.details())
        with pytest.raises(BadRequest, match="decode: KV_PAGES index 10000000 at position 2"):
            d.reserve("bad-r", 1000, p.address, indices=as_mapping(bad))
        with pytest.raises(UnknownRequest):
            d.status("bad-r")  # nothing was reserved
        assert free_slots(d) == DECODE_SLOTS
        # Send: decode holds good lists; prefill refuses a duplicate before queueing.
        dst_path = tmp_path / "dst.json"
        dst_path.write_text(json.dumps(as_mapping(dst)))
        out = run_cli("reserve", "--address", d.address, "--request-id", "bad-s", "--seq-len",
                      "1000", "--prefill", p.address, "--indices", str(dst_path), "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["slot"] == -1
        src, _ = shipped_lists("prefill", False, 1000, 2)
        dup = dict(src)
        dup[IndexKind.SWA_RING_ROWS] = dup[IndexKind.SWA_RING_ROWS].copy()
        dup[IndexKind.SWA_RING_ROWS][5] = dup[IndexKind.SWA_RING_ROWS][1]
        with pytest.raises(grpc.RpcError) as info:
            p.stub.Send(pb.SendRequest(request_id="bad-s", seq_len=1000, final_chunk=True,
                                       decode_address=d.address,
                                       indices=indices_to_proto(dup)), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(r"prefill: SWA_RING_ROWS index \d+ at position 5 repeats position 1",
                         str(info.value.details()))
        with pytest.raises(UnknownRequest):
            p.status("bad-s")
        snap = d.status("bad-s")
        assert snap.state is TransferState.BOOTSTRAPPING and snap.bytes_done == 0
        # The CLI refuses the same way (exit 2) and names the kind; then a good list moves.
        path = tmp_path / "src.json"
        path.write_text(json.dumps({k: v for k, v in as_mapping(src).items()
                                    if k != "REQ_SLOT"}))
        out = run_cli("send", "--address", p.address, "--request-id", "bad-s", "--seq-len",
                      "1000", "--decode", d.address, "--indices", str(path))
        assert out.returncode == 2 and "index lists missing for REQ_SLOT" in out.stderr + \
            out.stdout
        path.write_text(json.dumps(as_mapping(src)))
        out = run_cli("send", "--address", p.address, "--request-id", "bad-s", "--seq-len",
                      "1000", "--decode", d.address, "--indices", str(path), "--wait", "30")
        assert out.returncode == 0, out.stdout + out.stderr
        assert d.wait("bad-s", 30).detail.startswith(VERIFIED_PREFIX)


def test_the_scheduler_api_moves_a_chunked_request_at_the_engines_lists() -> None:
    with pair() as (_prefill, _decode, p, d):
        s, _ = shipped_lists("prefill", False, 2000, 5)
        dst, d_draft = shipped_lists("decode", False, 2000, 6, own_draft=True)
        d.reserve("eng-chunked", 2000, p.address, indices=as_mapping(dst, d_draft))
        src = as_mapping(s)
        p.send("eng-chunked", -1, 2000, d.address, final=False, chunks=[(0, 1024)],
               indices=src)
        p.send("eng-chunked", -1, 2000, d.address, final=True)  # the lists came first
        assert d.wait("eng-chunked", 60).detail.startswith(VERIFIED_PREFIX)
        assert p.wait("eng-chunked", 10).state is TransferState.SUCCESS
        d.release("eng-chunked")
