"""kvbeam as sglang's transfer backend over RDMA (soft-RoCE guest), one request.

As tests/host/test_sglang_backend.py: sglang's calls in the schedulers' order, the
state moved by RDMA WRITEs into the decode reference engine's memfd pools, and a
token-identical continuation. Also measures ``import sglang...base.conn`` in the
guest (TCG makes it slow), printed with the test's time.
"""

from __future__ import annotations

import importlib
import sys
import time

import pytest

from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.run import compare, make_prompt, torch_threads
from kvbeam.states import VERIFIED_PREFIX
from tests.daemon_helpers import SLOW_GUEST
from tests.rdma.conftest import RdmaDevice

pytestmark = pytest.mark.rdma


def test_sglang_calls_over_rdma_continue_token_identically(rdma_device: RdmaDevice) -> None:
    t0 = time.monotonic()
    fresh = "sglang.srt.disaggregation.base.conn" not in sys.modules
    importlib.import_module("sglang.srt.disaggregation.base.conn")
    imported = time.monotonic() - t0
    from tests.sglang_helpers import SglangPair

    config = tiny_config(unified=True, draft=True)
    with SglangPair(config, transport="rdma", timeout=120.0, chunk_tokens=128,
                    extra=tuple(SLOW_GUEST)) as pair:
        assert {d.transport for d in pair.daemons} == {"rdma"}
        started = time.monotonic() - t0
        with torch_threads(1):
            c = compare(config, make_prompt(250, 512, seed=250), 4, transfer=pair.transfer,
                        prefill_side=pair.prefill_pools, decode_side=pair.decode_pools)
        print(f"\nsglang rdma: import of sglang's base.conn {imported:.1f} s "
              f"({'fresh' if fresh else 'already imported'}), pair ready at {started:.1f} s, "
              f"done at {time.monotonic() - t0:.1f} s; equal {c.equal}\n{pair.table()}")
        assert pair.decode_status.detail.startswith(VERIFIED_PREFIX), pair.decode_status
        assert c.tokens_equal and c.proposals_equal, c.table()
        assert c.equal, c.table()
