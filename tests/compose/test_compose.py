"""docker-compose: the scheduler drives requests through containerised daemons.

On this host (no RDMA) the data plane is TCP; with KVBEAM_COMPOSE_RDMA=1 (inside the
soft-RoCE guest, ``make test-compose``) the RDMA override runs the same tests over rxe.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.compose.compose_env import RDMA, Compose, scheduler_json
from tests.compose.docker_env import Timings

# pytest-timeout: an hour, not pyproject's 900 s: the first test builds the image (its own
# steps are bounded at up to 30 min on a fresh machine) and the guest runs under TCG.
pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

#: The data plane the daemons must report (KVBEAM_TRANSPORT forces one, e.g. to try the
#: RDMA override's container settings over TCP on a host without RDMA).
TRANSPORT = os.environ.get("KVBEAM_TRANSPORT", "") or ("rdma" if RDMA else "tcp")
REQUESTS = 8
#: Decode's and prefill's Transferring deadline (the daemons' default).
DEADLINE_S = 30.0


@pytest.fixture
def compose(kvbeam_image: str, request: pytest.FixtureRequest) -> Iterator[Compose]:
    """A fresh compose project, torn down (containers, network) even when the test fails."""
    project = f"kvbeamit{os.getpid()}{request.node.name.split('_')[-1]}"
    c = Compose(project, kvbeam_image)
    c.down()
    try:
        yield c
    finally:
        c.down()


def test_compose_up_moves_and_verifies_every_request(compose: Compose, timings: Timings) -> None:
    """up --exit-code-from scheduler: exit 0, every request Success and XXH3-128-verified."""
    compose.env["KVBEAM_DRIVE_ARGS"] = f"--requests {REQUESTS} --max-len 8192 --concurrency 4"
    with timings.step("compose up (8 requests)"):
        proc = compose("up", "--no-build", "--abort-on-container-exit",
                       "--exit-code-from", "scheduler", timeout=900, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    table = compose.stdout("scheduler")
    assert f"{REQUESTS}/{REQUESTS} Success ({REQUESTS} XXH3-128-verified)" in table, table
    decode, prefill = compose.logs("decode"), compose.logs("prefill")
    for role, log in (("decode", decode), ("prefill", prefill)):
        assert f"kvbeam {role} listening on" in log, log
        assert f"{role} daemon: {TRANSPORT} transport" in log, log
        assert "Traceback" not in log and " ERROR " not in log, log
        assert f"{role} daemon stopped: nothing registered" in log, log  # SIGTERM reached it
        # The image compiles kvbeam's C helpers (docker/Dockerfile): its daemons use them.
        assert "integrity digests: compiled XXH3-128" in log, log
        if TRANSPORT == "rdma":
            assert "compiled WR poster" in log, log
    # The step lines (KVBEAM_LOG_REQUESTS): decode's Success says how it was verified. Each
    # transfer's end line (kvbeam.transfers, "Success, N/N bytes") says it again: one each.
    steps = [line for line in decode.splitlines() if ": Success (" in line]
    assert len(steps) == REQUESTS and all("XXH3-128 verified: " in s for s in steps), decode
    assert prefill.count(": Success (") == REQUESTS, prefill
    for log in (decode, prefill):
        assert log.count(" kvbeam.transfers: request ") == REQUESTS, log


def test_decode_stopped_mid_run(compose: Compose, timings: Timings) -> None:
    """Stop decode while requests move: the scheduler sees them fail by the stop itself
    (not at a deadline), exits 1, and prefill stays healthy. Prefill's wire is slowed
    (tests/compose/slow-wire.yaml: fault injection, armed by its flag) so that the
    requests in flight are being written when decode stops: over TCP a request's
    transfer is otherwise a few milliseconds of its life, and a stop once found every
    one in flight past decode's Success, waiting for its Release."""
    compose.overrides.append("tests/compose/slow-wire.yaml")
    # Every request 16k tokens (5 MB; random 1..32k averaged the same): its transfer is most
    # of its life, so when decode stops some of the four in flight are moving (random
    # lengths once left all four between decode's Success and the scheduler's Release, and
    # none was reported Failed), and four of them fit the soft-RoCE guest's wire (~7 MB/s)
    # inside the default Transferring budget.
    compose.env["KVBEAM_DRIVE_ARGS"] = "--requests 1000 --seq-lens 16384 --concurrency 4 --json"
    compose("up", "-d", "--no-build", timeout=600)
    compose.wait_log("decode", "XXH3-128 verified: ", 3, timeout=300)
    with timings.step("stop decode -> scheduler exit"):  # timed for the docs, not asserted
        compose("stop", "-t", "10", "decode", timeout=60)
        code = compose.wait_exit("scheduler", timeout=DEADLINE_S + 60)
    results = scheduler_json(compose.stdout("scheduler"))
    logs = compose.logs("scheduler")
    assert code == 1, logs[-4000:]
    assert len(results) == 1000
    ok = [r for r in results if r["ok"]]
    assert ok and all(r["verified"] for r in ok)
    failed = [r for r in results if not r["ok"]]
    assert failed, "every request succeeded: decode stopped too late"
    # Nothing hangs: each failed request ended Failed on decode or prefill, or was refused.
    for r in failed:
        assert r["state"].startswith(("Failed(", "error: ")), r
        # Ended by the stop, on both sides: decode failed it at its shutdown or was gone,
        # and prefill had its answer when the scheduler asked (it waits 10 s): Failed (by
        # decode's Abort or the loss of its peer channel), Success (every byte written
        # before), or never sent ("?"). Not left to a deadline: none is Failed(timeout,
        # "no progress in ...") and none still moving, which prefill's Transferring
        # deadline (DEADLINE_S) would end later.
        assert r["prefill_state"] == "?" or r["prefill_state"].startswith(
            ("Failed(", "Success")), r
        assert not any(s.startswith("Failed(timeout, ") for s in (r["state"],
                                                                  r["prefill_state"])), r
    affected = [r for r in failed if r["state"].startswith("Failed(")
                or r["prefill_state"].startswith("Failed(")]
    assert affected, f"no request in flight was reported Failed: {failed[:4]}"
    prefill_log = compose.logs("prefill")
    assert "FAULT INJECTION ENABLED" in prefill_log, prefill_log[-3000:]  # armed, and said so
    for r in affected:
        if r["prefill_state"].startswith("Failed("):
            assert f"request {r['request_id']} failed" in prefill_log, r
    # prefill is still serving: docker's health check and a direct gRPC health call.
    assert compose.health("prefill") == "healthy"
    addr = "127.0.0.1:50051"
    probe = compose("exec", "-T", "prefill", "python", "-m", "kvbeam.commands.health", addr,
                    check=False)
    assert probe.returncode == 0, probe.stdout + probe.stderr
