"""Head of line: a stalled decode daemon must not delay prefill's requests to another one.

Prefill serves two decode daemons, A and B. B is stopped (SIGSTOP) before prefill
ever handshakes with it, so each handshake with B hangs until prefill's RPC deadline.
While requests to B wait on that handshake, a batch of requests to A must complete
at loopback speed: the measured Send -> Success delay of A's requests stays far below
the RPC deadline B's requests wait on.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from kvbeam.client import KvbeamClient
from kvbeam.states import TransferState
from tests.daemon_helpers import start

log = logging.getLogger(__name__)

#: Prefill's RPC deadline: how long a handshake with the stopped B hangs.
RPC_TIMEOUT_S = 8.0
#: Requests queued for B: as many as prefill's send workers (the old code's pool size).
TO_B = 8
TO_A = 8
#: Loopback requests of a few hundred tokens take milliseconds; this bound is generous,
#: and still far below the RPC deadline a head-of-line block would add.
BOUND_S = 2.5
LONG = ["--rpc-timeout-s", str(RPC_TIMEOUT_S), "--deadline-bootstrap-s", "30",
        "--deadline-waiting-s", "30", "--deadline-transfer-s", "30"]


def test_stalled_decode_does_not_delay_requests_to_another() -> None:
    prefill = start("prefill", extra=LONG)
    a = start("decode", extra=LONG)
    b = start("decode", extra=LONG)
    stopped = False
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(a.address) as da, \
                KvbeamClient(b.address) as db:
            for i in range(TO_B):
                db.reserve(f"b{i}", 256, prefill.address)
            os.kill(b.proc.pid, signal.SIGSTOP)
            stopped = True
            for i in range(TO_B):
                p.send(f"b{i}", i % 8, 256, b.address)
            time.sleep(0.5)  # B's handshake is now in flight and hangs
            sent: dict[str, float] = {}
            for i in range(TO_A):
                rid = f"a{i}"
                da.reserve(rid, 256, prefill.address)
                sent[rid] = time.monotonic()
                p.send(rid, i % 8, 256, a.address)
            done: dict[str, float] = {}
            states: dict[str, TransferState] = {}
            end = time.monotonic() + 4 * RPC_TIMEOUT_S
            while len(done) < TO_A and time.monotonic() < end:
                for rid in sent:
                    if rid in done:
                        continue
                    st = p.status(rid)
                    if st.terminal:
                        done[rid] = time.monotonic()
                        states[rid] = st.state
                time.sleep(0.01)
            delays = sorted(done[r] - sent[r] for r in done)
            log.warning("head of line: A's Send->Success delays while B stalls: %s",
                        ", ".join(f"{d:.3f}" for d in delays))
            print(f"HOL delays (s): {[round(d, 3) for d in delays]}")
            assert len(done) == TO_A, f"only {len(done)} of {TO_A} requests to A ended"
            assert all(s is TransferState.SUCCESS for s in states.values()), states
            assert max(delays) < BOUND_S, (
                f"requests to A waited up to {max(delays):.2f} s behind the stalled B "
                f"(RPC deadline {RPC_TIMEOUT_S} s)")
            # B's requests are still stuck behind its handshake, or failed by it: never Success.
            assert all(p.status(f"b{i}").state is not TransferState.SUCCESS
                       for i in range(TO_B))
    finally:
        if stopped:
            os.kill(b.proc.pid, signal.SIGCONT)
        prefill.stop()
        a.stop()
        b.stop()
