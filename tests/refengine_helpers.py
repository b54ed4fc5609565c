"""Checks shared by the reference-engine tests over real daemons (host TCP and RDMA guest)."""

from __future__ import annotations

from kvbeam.refengine.run import Comparison
from kvbeam.scheduler import RequestResult
from kvbeam.states import VERIFIED_PREFIX


def check_served(label: str, c: Comparison, rec: RequestResult, *, draft: bool,
                 seconds: float) -> None:
    """Print the run's row and assert it: verified Success, identical continuation."""
    print(f"\n{label} prompt {c.seq_len}: {len(c.reference.tokens)} tokens, equal {c.equal}, "
          f"{rec.bytes} bytes, send->success {rec.send_to_success_s * 1e3:.1f} ms, "
          f"{seconds:.1f} s")
    assert rec.ok and rec.detail.startswith(VERIFIED_PREFIX), rec
    assert rec.bytes > 0
    assert c.tokens_equal, c.table()
    assert c.proposals_equal, c.table()
    assert bool(c.moved.proposals) is draft
    assert c.equal, c.table()
