"""Test-only fault injection for the daemons: inert unless an environment variable arms it.

``KVBEAM_TEST_FAULT_OUTSIDE_MR=PREFIX`` (prefill): for every request whose id starts
with ``PREFIX``, the first block is aimed just past the end of decode's lowest
registered region and prefill's own bounds check is skipped for that link, so decode's
RDMA device itself refuses the write (``IBV_WC_REM_ACCESS_ERR``) and both queue pairs go
to the error state, as a corrupt address or rkey would make them. The RDMA fault tests
(tests/rdma/test_faults_rdma.py) use it to prove that such a request fails with the verbs
status and that the next request handshakes a fresh queue pair. Nothing else should.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from kvbeam.transport.base import Link
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.endpoint import Endpoint

log = logging.getLogger(__name__)

OUTSIDE_MR_ENV = "KVBEAM_TEST_FAULT_OUTSIDE_MR"


def outside_mr_prefix() -> str:
    """The armed request-id prefix, or "" (no fault); warns loudly when armed."""
    prefix = os.environ.get(OUTSIDE_MR_ENV, "")
    if prefix:
        log.warning("TEST FAULT ARMED (%s): requests %s* will write outside decode's memory "
                    "regions; never set this outside tests", OUTSIDE_MR_ENV, prefix)
    return prefix


def outside_peer_mr(link: Link, peer: Endpoint, blocks: Blocks) -> Blocks:
    """``blocks`` with the first one moved just past the peer's lowest region, unchecked.

    The link is doomed once the write is posted (its QP goes to the error state), so
    switching its remote bounds check off (a test-only attribute of both transports'
    links) affects no healthy traffic.
    """
    if not len(blocks) or not peer.regions:
        return blocks
    lowest = min(peer.regions, key=lambda r: r.addr)
    dst = blocks.dst.copy()
    dst[0] = np.uint64(lowest.addr + lowest.length)
    unchecked: Any = link  # _check_remote exists on VerbsLink and TcpLink only, for tests
    unchecked._check_remote = False
    log.warning("TEST FAULT: writing %d bytes at %#x, just past decode's region %#x+%d",
                int(blocks.lengths[0]), int(dst[0]), lowest.addr, lowest.length)
    return Blocks(blocks.src, dst, blocks.lengths)
