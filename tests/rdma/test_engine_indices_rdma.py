"""Engine-chosen (shuffled, fragmented) index lists over RDMA (soft-RoCE), verified.

One unified daemon pair: requests whose pages, state items and ring rows the
engine scattered over its pools (the decode side with a draft list of its own)
end XXH3-128-verified; then the same request sizes with slot-contiguous,
page-scattered and fully shuffled lists, figures left in
``$KVBEAM_RESULTS_DIR/engine_indices.json`` (the harness prints it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvbeam.states import VERIFIED_PREFIX, TransferState
from tests.bench.bench_engine_indices import transfer_rows
from tests.daemon_helpers import pair
from tests.engine_lists import as_mapping, shipped_lists
from tests.rdma.conftest import RdmaDevice

pytestmark = pytest.mark.rdma


def test_engine_lists_over_rdma_and_their_cost(rdma_device: RdmaDevice) -> None:
    with pair(transport="rdma") as (prefill, decode, p, d):
        assert prefill.transport == decode.transport == "rdma"
        src, _ = shipped_lists("prefill", False, 4097, 3)
        dst, d_draft = shipped_lists("decode", False, 4097, 4, own_draft=True)
        d.reserve("eng-rdma", 4097, p.address, indices=as_mapping(dst, d_draft))
        p.send("eng-rdma", -1, 4097, d.address, indices=as_mapping(src))
        final = d.wait("eng-rdma", 120)
        assert final.state is TransferState.SUCCESS, str(final)
        assert final.detail.startswith(VERIFIED_PREFIX), final.detail
        d.release("eng-rdma")
        rows = transfer_rows(p, d, (8192, 32768), runs=3)
    out = os.environ.get("KVBEAM_RESULTS_DIR")
    if out:
        Path(out, "engine_indices.json").write_text(json.dumps(rows))
    assert {r["lists"] for r in rows} == {"slot", "pages", "engine"}
