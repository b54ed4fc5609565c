"""Token-identical continuation through two ``--pools engine`` daemons over RDMA (soft-RoCE).

As tests/host/test_refengine_daemons.py, over RDMA WRITEs into the decode engine's
memfd pools (MRs over the daemons' MAP_SHARED mappings): one prompt per mode.
"""

from __future__ import annotations

import time

import pytest

from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.run import compare, make_prompt, torch_threads
from kvbeam.refengine.served import ServedPair
from tests.daemon_helpers import SLOW_GUEST
from tests.rdma.conftest import RdmaDevice
from tests.refengine_helpers import check_served

pytestmark = pytest.mark.rdma
K = 4


@pytest.mark.parametrize(("unified", "draft", "length"), [(True, True, 250), (False, True, 256)],
                         ids=["unified-draft-250", "paged-draft-256"])
def test_continuation_over_rdma_daemons_is_token_identical(
        rdma_device: RdmaDevice, unified: bool, draft: bool, length: int) -> None:
    config = tiny_config(unified=unified, draft=draft)
    t0 = time.monotonic()
    with ServedPair(config, transport="rdma", extra=tuple(SLOW_GUEST), timeout=120.0) as pair:
        assert pair.prefill.transport == "rdma" and pair.decode.transport == "rdma"
        with torch_threads(1):
            c = compare(config, make_prompt(length, 512, seed=length), K, transfer=pair.transfer,
                        prefill_side=pair.prefill_pools, decode_side=pair.decode_pools)
        check_served(f"{'unified' if unified else 'paged'}-draft rdma", c, pair.records[-1],
                     draft=draft, seconds=time.monotonic() - t0)
