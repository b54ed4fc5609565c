"""A partial load (``kv_skip``) over RDMA (soft-RoCE): only the pages after the held
prefix are written, and they verify.

A prefill/decode pair of slot-pool daemons on a vLLM-shaped paged config (KV pages
only), fill patterns by seed. Decode reserves the last 14 of a 700-token request's 44
pages (``kv_skip`` 30, its engine holding the first 30); prefill sends its whole
lists. Decode's XXH3-128 check passes only if prefill digested (and wrote) exactly its
pages from position 30 on against decode's shorter list; both daemons count the 14
pages' bytes only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvbeam.client import KvbeamClient
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
from kvbeam.states import VERIFIED_PREFIX, TransferState
from tests.attach_helpers import write_config
from tests.daemon_helpers import start
from tests.metrics_helpers import scrape, value
from tests.rdma.conftest import RdmaDevice

pytestmark = pytest.mark.rdma

LAYERS = 4
SPEC = paged_spec(num_layers=LAYERS, block_size=16, num_kv_heads=2, head_size=64,
                  dtype="bfloat16", inner_layout="LBHNC", num_blocks=512)
SEQ, SKIP = 700, 30
PAGES = -(-SEQ // SPEC.page_size)


def test_a_partial_load_over_rdma_moves_only_the_pages_after_kv_skip(
        rdma_device: RdmaDevice, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "paged.yaml", paged_side_config("paged-rdma", SPEC))
    decode = start("decode", transport="rdma", cfg=cfg, extra=["--metrics", "127.0.0.1:0"])
    prefill = start("prefill", transport="rdma", cfg=cfg, extra=["--metrics", "127.0.0.1:0"])
    try:
        rng = np.random.default_rng(7)
        src = rng.choice(SPEC.max_pages_per_req, PAGES, replace=False).tolist()
        dst = rng.choice(SPEC.max_pages_per_req, PAGES, replace=False).tolist()
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            d.reserve("skip-rdma", SEQ, p.address, indices={"KV_PAGES": dst[SKIP:]},
                      kv_skip=SKIP)
            p.send("skip-rdma", -1, SEQ, d.address, indices={"KV_PAGES": src})
            final = d.wait("skip-rdma", 120)
            assert final.state is TransferState.SUCCESS, str(final)
            assert final.detail.startswith(VERIFIED_PREFIX), final.detail
            d.release("skip-rdma")
        moved = (PAGES - SKIP) * LAYERS * block_bytes(SPEC)
        for daemon in (prefill, decode):
            assert value(scrape(daemon.metrics), "kvbeam_request_bytes_total") == moved
    finally:
        prefill.stop()
        decode.stop()
