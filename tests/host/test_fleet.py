"""8 prefill x 8 decode daemons over TCP: every prefill talks to every decode, one handshake
and one link per pair, reused; per-daemon counts grow with peers, not with requests."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

from tests.control_helpers import run_cli
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
        # The CLI scheduler over the same fleet: flags repeated and comma-separated, the
        # host's own name in the dns: form; 32 requests spread over every decode.
        ports = [d.address.rsplit(":", 1)[1] for d in decodes]
        drv = run_cli("drive", "--prefill", ",".join(p.address for p in prefills[:4]),
                      *[a for p in prefills[4:] for a in ("--prefill", p.address)],
                      "--decode", f"dns:localhost:{ports[0]}",
                      "--decode", ",".join(d.address for d in decodes[1:]),
                      "--requests", "32", "--concurrency", "8", "--max-len", "2000",
                      "--source-slots", "4", "--json")
        assert drv.returncode == 0, drv.stdout + drv.stderr
        used = Counter(r["decode"] for r in json.loads(drv.stdout))
        assert set(used) == {d.address for d in decodes}, used
        assert all(r["attempts"] == 1 for r in json.loads(drv.stdout))
    print(f"\n{text}\n  start-up of {N + M} daemons {started:.1f} s, "
          f"total {time.monotonic() - t0:.1f} s")
