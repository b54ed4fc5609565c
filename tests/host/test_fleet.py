"""8 prefill x 8 decode daemons over TCP: every prefill talks to every decode, one handshake
and one link per pair, reused; per-daemon counts grow with peers, not with requests."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tests.fleet_helpers import assert_per_peer_not_per_request, every_pair, fleet, table

log = logging.getLogger(__name__)

N = M = 8


def test_8x8_every_pair_one_handshake_reused(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with fleet(N, M, tmp_path, slots=4, max_context=2048) as (prefills, decodes, _cfgs):
        started = time.monotonic() - t0
        run = every_pair(prefills, decodes, seq_len=2000, rounds=2)
        assert_per_peer_not_per_request(run, prefills, decodes)
        # the second round's requests all landed (64 more Successes per side, summed)
        for role, group in (("prefill", prefills), ("decode", decodes)):
            done = sum(run.figures[-1][d.address]["success"] for d in group)
            assert done == 2 * N * M, (role, done)
        text = table(run, prefills, decodes)
    print(f"\n{text}\n  start-up of {N + M} daemons {started:.1f} s, "
          f"total {time.monotonic() - t0:.1f} s")
