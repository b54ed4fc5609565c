"""The whole-request peer's block lists (tests/bench/request_blocks.py) and the CPU counter."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.bench.bench_request import cpu_s
from tests.bench.request_blocks import STYLES, region_sizes, request_blocks, request_case

#: Bytes a unified dsv4-tiny request moves through the daemons (docs/performance.md).
DAEMON_BYTES = {8192: 2_777_088, 32768: 10_002_432}


@pytest.mark.parametrize("tokens", sorted(DAEMON_BYTES))
def test_every_style_moves_the_daemons_bytes_inside_the_regions(tokens: int) -> None:
    src_size, dst_size = region_sizes()
    counts = {}
    for style in STYLES:
        b = request_blocks(request_case(tokens, style))
        assert b.total_bytes == DAEMON_BYTES[tokens]
        assert int((b.src + b.lengths).max()) <= src_size
        assert int((b.dst + b.lengths).max()) <= dst_size
        order = np.argsort(b.dst)  # destination blocks never overlap
        ends = (b.dst + b.lengths)[order]
        assert (ends[:-1] <= b.dst[order][1:]).all()
        counts[style] = len(b)
    assert counts["slot"] < counts["pages"] < counts["engine"]


def test_lists_are_seeded_and_slot_lists_need_no_client_lists() -> None:
    a, b = request_case(8192, "engine"), request_case(8192, "engine")
    assert all((a.dst[k] == b.dst[k]).all() for k in a.dst)
    assert request_case(8192, "slot").client_lists() == (None, None)
    src, dst = a.client_lists()
    assert src is not None and dst is not None and set(src) == {k.value for k in a.src}
    with pytest.raises(ValueError, match="unknown list style"):
        request_case(8192, "nope")


def test_cpu_s_counts_this_process() -> None:
    before = cpu_s(os.getpid())
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    assert cpu_s(os.getpid()) - before >= 0.05
