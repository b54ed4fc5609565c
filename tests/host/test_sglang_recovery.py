"""Every sglang request ends when a kvbeam daemon dies under load, behind sglang's router.

sglang's prefill and decode servers (``--disaggregation-transfer-backend kvbeam``),
their two daemons (``--metrics`` on) and sglang's router, as docs/sglang.md runs them.
Clients send requests through the router; the decode daemon is SIGKILLed while some
are in flight and more arrive after it; then, once the pair serves again, the prefill
daemon the same way. Every client request must end with sglang's own answer, none cut
by the client's timeout (:data:`BOUND_S` + 60 s, before sglang's own 300 s deadlines)
and none failed by one of sglang's deadlines (its error would name it): the cause was
handled, not waited out; each failed one with kvbeam's cause in its error, and
afterwards nothing is held: both servers' queues (sglang's ``/v1/loads``: running,
waiting, bootstrap, inflight, prealloc, transfer) empty and the surviving daemon's
``kvbeam_transfers_live`` 0.

The issue this guards: after the decode daemon was SIGKILLed, 2 of 6 new requests sat
in prefill's bootstrap queue for more than 6.5 minutes (decode had failed them at once;
its ``clear()`` deleted their rooms, which prefill read as "not posted yet").

Then the killed daemon is started again with the same flags and nothing else: the
server beside it attaches its pools again by itself (``reattach``), and the pair must
give the output it gave before, without restarting sglang.

Runs in the sglang server venv (``make test-sglang``); elsewhere it is skipped, and
KVBEAM_REQUIRE_SGLANG_SERVER=1 turns the skip into a failure.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.metrics_helpers import scrape, value
from tests.sglang_server_helpers import (
    Process,
    daemon,
    free_port,
    generate,
    require_sglang_server,
    router,
    sglang_server,
    write_model,
)

pytestmark = require_sglang_server()

#: Every client request must end within this many seconds of being sent (the client
#: gives up 60 s later; the time each took is printed, not asserted).
BOUND_S = 120.0
#: What a request failed by one of sglang's disaggregation deadlines says: kvbeam's
#: backend names the variable (kvbeam/integrations/sglang/conn.py), sglang's own
#: transfer backends "timed out after N s in KVPoll.Bootstrapping".
SGLANG_DEADLINE = re.compile(r"SGLANG_DISAGGREGATION_[A-Z_]*TIMEOUT|timed out after \S+ in KVPoll")
#: Requests sent one every :data:`GAP_S`, the daemon killed after the first
#: :data:`KILLED_AFTER` of them: (prompt tokens, new tokens). Long generations (decoding
#: at the kill) and long prompts (prefilled in 256-token chunks, their KV moving).
STREAM = ((100, 1200), (140, 1200), *((900 + 60 * i, 16) for i in range(6)),
          *((60 + 40 * i, 16) for i in range(6)))
KILLED_AFTER = 6
GAP_S = 0.25
#: New tokens of the reference request, before the kill and after the restart.
NEW_TOKENS = 48
#: sglang's queues that hold a disaggregated request (``/v1/loads``).
QUEUES = ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
          "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs")


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids from a seeded generator."""
    return [int(t) for t in np.random.default_rng(n * 7919 + seed).integers(3, 1000, n)]


@dataclass
class Outcome:
    """One client request: how long it took and what came back."""

    sent_after_kill: bool
    seconds: float = -1.0
    ended_at: float = 0.0  # monotonic
    reply: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return "output_ids" in self.reply


@dataclass
class Pair:
    """The served pair; each side's daemon and server can be killed and started again."""

    work: Path
    model: str
    ports: dict[str, int]
    procs: dict[str, Process] = field(default_factory=dict)
    starts: int = 0

    def start_daemon(self, role: str) -> None:
        self.starts += 1
        p = self.ports
        self.procs[f"{role} daemon"] = daemon(
            role, f"127.0.0.1:{p[role[0] + 'd']}", self.work / f"{role}.sock",
            self.work / f"{role}-daemon-{self.starts}.log",
            extra=("--metrics", f"127.0.0.1:{p[role[0] + 'm']}"))

    def start_server(self, role: str) -> None:
        self.starts += 1
        p = self.ports
        extra = (["--disaggregation-decode-retraction-backup", "none"]
                 if role == "decode" else [])
        proc = sglang_server(
            role, self.model, p[role], self.work / f"{role}-{self.starts}.log",
            "--disaggregation-mode", role, "--disaggregation-transfer-backend", "kvbeam",
            "--disaggregation-bootstrap-port", str(p["boot"]), *extra,
            env={"KVBEAM_DAEMON": f"127.0.0.1:{p[role[0] + 'd']}",
                 "KVBEAM_ATTACH_SOCKET": str(self.work / f"{role}.sock")})
        self.procs[f"{role} server"] = proc
        proc.wait_for("The server is fired up")

    def metrics(self, role: str) -> str:
        return f"127.0.0.1:{self.ports[role[0] + 'm']}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("sglang-recovery")
    ports = {k: free_port() for k in ("pd", "dd", "pm", "dm", "prefill", "decode", "boot",
                                      "router")}
    served = Pair(work, write_model(work / "model"), ports)
    try:
        for role in ("prefill", "decode"):
            served.start_daemon(role)
        for role in ("prefill", "decode"):
            served.start_server(role)
        served.procs["router"] = router(ports["router"], f"http://127.0.0.1:{ports['prefill']}",
                                        ports["boot"], f"http://127.0.0.1:{ports['decode']}",
                                        work / "router.log")
        served.procs["router"].wait_listening(ports["router"])
        yield served
    finally:
        for p in reversed(list(served.procs.values())):
            p.stop()


def _load(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/loads", timeout=60) as resp:
        load = json.loads(resp.read())["loads"][0]
    disagg = load.get("disaggregation", {})
    out = {q: int(disagg.get(q, 0)) for q in QUEUES}
    out["num_running_reqs"] = int(load.get("num_running_reqs", 0))
    out["num_waiting_reqs"] = int(load.get("num_waiting_reqs", 0))
    return out


def _under_load(served: Pair, kill: Callable[[], None], seed: int
                ) -> tuple[list[Outcome], float]:
    """:data:`STREAM`, one request every :data:`GAP_S`, with ``kill()`` after the first
    :data:`KILLED_AFTER`; every request's outcome once all ended (or :data:`BOUND_S`
    passed), and when the kill was."""
    outcomes: list[Outcome] = []
    threads: list[threading.Thread] = []

    def one(out: Outcome, tokens: list[int], new: int) -> None:
        start = time.monotonic()
        try:
            out.reply = generate(served.ports["router"], tokens, new, timeout=BOUND_S + 60)
        except OSError as exc:  # the router hung up, or the client's own timeout
            out.reply = {"error": "client", "detail": str(exc)}
        out.ended_at = time.monotonic()
        out.seconds = out.ended_at - start

    killed_at = 0.0
    prompts = [(prompt(n, seed + i), new) for i, (n, new) in enumerate(STREAM)]
    # Sent on a schedule from the first send (not a sleep after each start): on a loaded
    # host starting a thread took 0.3 s, so the kill came after the long generations ended.
    first = time.monotonic()
    for i, (tokens, new) in enumerate(prompts):
        time.sleep(max(first + i * GAP_S - time.monotonic(), 0.0))
        if i == KILLED_AFTER:
            killed_at = time.monotonic()
            kill()
        out = Outcome(sent_after_kill=i >= KILLED_AFTER)
        outcomes.append(out)
        t = threading.Thread(target=one, args=(out, tokens, new))
        threads.append(t)
        t.start()
    deadline = time.monotonic() + BOUND_S + 90
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.1))
    return outcomes, killed_at


def _assert_all_ended(outcomes: list[Outcome], killed_at: float) -> None:
    rows = [f"{'after' if o.sent_after_kill else 'before'} kill: {o.seconds:.1f} s "
            f"{'ok' if o.ok else json.dumps(o.reply)[:400]}" for o in outcomes]
    print("\n" + "\n".join(rows))
    caught = [o for o in outcomes if not o.sent_after_kill and o.ended_at > killed_at]
    print(f"sent before the kill and still in flight at it: {len(caught)}, of which "
          f"{sum(not o.ok for o in caught)} failed")
    unfinished = [o for o in outcomes if o.seconds < 0]
    assert not unfinished, f"{len(unfinished)} requests never ended:\n" + "\n".join(rows)
    # Each got sglang's answer: none was cut by the client's own timeout, and none failed
    # by one of sglang's deadlines (waited out, not handled).
    assert not [o for o in outcomes if o.reply.get("error") == "client"], rows
    assert not [o for o in outcomes if SGLANG_DEADLINE.search(json.dumps(o.reply))], rows
    # Under load: requests were still in flight when the daemon died.
    assert any(o.ended_at > killed_at for o in outcomes if not o.sent_after_kill), rows
    # Those sent after the kill cannot move: each fails.
    assert all(not o.ok for o in outcomes if o.sent_after_kill), rows
    for o in outcomes:
        if not o.ok:  # an error from sglang carrying kvbeam's cause, not a bare 500
            text = json.dumps(o.reply)
            assert o.reply.get("error") not in (None, "client"), o.reply
            assert "kvbeam" in text or "gave room" in text, o.reply


def _assert_nothing_held(served: Pair, roles: tuple[str, ...]) -> None:
    """Both servers' queues empty, and each named role's daemon has no live transfer."""
    deadline = time.monotonic() + 60
    for server in ("prefill", "decode"):
        while any(_load(served.ports[server]).values()):
            assert time.monotonic() < deadline, (server, _load(served.ports[server]))
            time.sleep(0.5)
    for role in roles:
        live = value(scrape(served.metrics(role)), "kvbeam_transfers_live")
        while live:
            assert time.monotonic() < deadline, (role, live)
            time.sleep(0.5)
            live = value(scrape(served.metrics(role)), "kvbeam_transfers_live")


def _restart(served: Pair, role: str) -> None:
    """The killed daemon started again with the same flags; the server beside it, not
    restarted, attaches its pools again by itself."""
    served.start_daemon(role)
    served.procs[f"{role} daemon"].wait_for("attached on", timeout=120)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_daemon_sigkilled_under_load_ends_every_request_and_recovers(pair: Pair,
                                                                        role: str) -> None:
    reference = generate(pair.ports["router"], prompt(150, 99), NEW_TOKENS)
    assert "output_ids" in reference, reference
    server = pair.procs[f"{role} server"].proc
    killed = pair.procs[f"{role} daemon"]
    outcomes, killed_at = _under_load(pair, killed.proc.kill,
                                      seed=10 if role == "decode" else 20)
    killed.proc.wait(30)
    killed.stop()  # its log file
    _assert_all_ended(outcomes, killed_at)
    survivor = "prefill" if role == "decode" else "decode"
    _assert_nothing_held(pair, (survivor,))
    _restart(pair, role)
    # The same sglang server, never restarted, attached again (the daemon logged it).
    assert server.poll() is None and pair.procs[f"{role} server"].proc is server
    again = generate(pair.ports["router"], prompt(150, 99), NEW_TOKENS)
    assert again.get("output_ids") == reference["output_ids"], again
    _assert_nothing_held(pair, ("prefill", "decode"))
