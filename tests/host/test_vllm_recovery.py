"""vLLM recovers from a restarted kvbeam daemon without a restart of its own (issue 45).

One deployment (tests/vllm_served.py): a prefill and a decode ``vllm serve`` with the
kvbeam connector behind vllm-router (decode's ``kv_load_failure_policy`` ``fail``), each
with its own ``--pools engine`` daemon, and a plain ``vllm serve``. Each daemon in turn
is SIGKILLed and started again with the same flags (its ``--listen`` port included).
While it is down every request through the router ends (an error is fine: the load or
the send fails at once, or at decode's bootstrap deadline) within a generous bound, none
hangs; once the workers attached the same memory again (the daemon's health is SERVING
only with an engine attached), a request through the router is token-identical to the
plain server's and its KV moved (decode's daemon counted the transfer). The vLLM servers
are the same processes throughout.

Then, under load (four client requests at once through the router), each daemon and
each vLLM server in turn is SIGKILLed: every client request ends within the bound,
none hangs; what was killed is started again with the same flags, and nothing is left
in use on any server or daemon (``kvbeam_transfers_live`` 0 on both daemons, vLLM's
running requests and KV cache usage 0 on both servers); a request after is again
token-identical to the plain server's.

Runs only where vLLM and vllm-router are installed in the interpreter running pytest
(``make test-vllm``); KVBEAM_REQUIRE_VLLM=1 turns the skip into a failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from tests.attach_helpers import start_engine_daemon
from tests.vllm_helpers import require_vllm
from tests.vllm_served import (
    Completion,
    Deployment,
    Served,
    complete,
    kv_config,
    metric,
    start_deployment,
    vllm_serve,
)

pytestmark = require_vllm("vllm", "vllm_router")

log = logging.getLogger(__name__)
MAX_TOKENS = 6
#: Decode's reservation gives up after --deadline-bootstrap-s when no Send comes (the
#: prefill daemon is down): the longest a request waits while a daemon is down.
DEADLINES = ["--deadline-bootstrap-s", "10", "--deadline-waiting-s", "30",
             "--deadline-transfer-s", "30", "--heartbeat-s", "1", "--rpc-timeout-s", "5",
             "--handoff-lease-s", "60", "--send-wait-s", "10", "--log-level", "INFO"]
SERVE_ARGS = ["--enable-prefix-caching", "--max-num-seqs", "4"]
#: Each client request while a daemon is down must end within this (it fails at once,
#: or at decode's 10 s bootstrap deadline; generous for the shared 2-core host).
END_BOUND_S = 180.0


@dataclass
class Recovery:
    deployment: Deployment
    work: Path


@pytest.fixture(scope="module")
def recovery(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recovery]:
    work = tmp_path_factory.mktemp("vllm-recovery")
    deployment = start_deployment(work, SERVE_ARGS, DEADLINES)
    try:
        yield Recovery(deployment, work)
    finally:
        deployment.stop()


def _prompt(seed: int, n: int = 80) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1024, n)]


def _same_as_plain(d: Deployment, prompt: list[int]) -> tuple[Completion, Completion]:
    with ThreadPoolExecutor(2) as pool:
        via = pool.submit(complete, d.router.url, prompt, MAX_TOKENS)
        plain = pool.submit(complete, d.plain.url, prompt, MAX_TOKENS)
        return via.result(), plain.result()


def _restart(r: Recovery, name: str) -> DaemonProcess:
    """SIGKILL daemon ``name`` and start it again with the same flags and port."""
    old = r.deployment.daemons[name]
    old.kill()
    port = old.address.rpartition(":")[2]
    new = start_engine_daemon(old.role, str(r.work / f"{name}.sock"), deadlines=DEADLINES,
                              extra=["--listen", f"127.0.0.1:{port}"])
    r.deployment.daemons[name] = new
    return new


def _timed(url: str, prompt: list[int]) -> tuple[float, Completion | None, str]:
    t0 = time.monotonic()
    try:
        got = complete(url, prompt, MAX_TOKENS, timeout=END_BOUND_S)
    except OSError as exc:  # the bound passed (a hang), or the connection broke
        return time.monotonic() - t0, None, repr(exc)
    return time.monotonic() - t0, got, ""


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_a_restarted_daemon_is_re_attached_and_requests_recover_without_restarting_vllm(
        recovery: Recovery, name: str) -> None:
    d = recovery.deployment
    servers = {s.name: s.proc.pid for s in (d.prefill, d.decode)}
    seed = 100 if name == "decode" else 200
    via, plain = _same_as_plain(d, _prompt(seed))
    assert via.status == 200 and via.tokens == plain.tokens, (via, plain)
    victim = d.daemons[name]
    victim.kill()
    # While it is down: every request ends, none hangs.
    with ThreadPoolExecutor(3) as pool:
        ended = list(pool.map(lambda i: _timed(d.router.url, _prompt(seed + 1 + i)),
                              range(3)))
    print(f"\n{name} daemon down: requests through the router ended after "
          + ", ".join(f"{s:.1f} s ({got.status if got else why})" for s, got, why in ended))
    for _took, got, why in ended:
        assert got is not None, f"a request did not end within {END_BOUND_S} s: {why}"
    # Started again with the same flags: the worker attaches the same memory again.
    t0 = time.monotonic()
    restarted = _restart(recovery, name)
    with KvbeamClient(restarted.address) as c:
        assert c.wait_healthy(120), f"no engine re-attached to {name}'s daemon:\n" \
                                    + restarted.output[-3000:]
    print(f"{name} daemon restarted; its vLLM worker re-attached within "
          f"{time.monotonic() - t0:.1f} s of the start")
    before = d.landed("decode")[0]
    via, plain = _same_as_plain(d, _prompt(seed + 10))
    assert via.status == 200, (via.status, via.error, restarted.output[-3000:])
    assert via.tokens == plain.tokens, (via.tokens, plain.tokens)
    assert d.landed("decode")[0] > before, "decode computed the prompt: no KV moved"
    # The same vLLM processes served it.
    assert {s.name: s.proc.pid for s in (d.prefill, d.decode)} == servers
    assert d.prefill.proc.poll() is None and d.decode.proc.poll() is None
    worker = d.decode if name == "decode" else d.prefill
    assert worker.log("re-attached to"), "".join(worker.lines[-50:])


def _restart_server(r: Recovery, name: str) -> Served:
    """SIGKILL vLLM server ``name`` (and its engine core and workers) and start it again
    with the same flags and port; returns once it answers."""
    d = r.deployment
    old = d.decode if name == "decode" else d.prefill
    old.kill()
    model = str(r.work / "tiny-llama")  # start_deployment wrote it (the others map it)
    sock = str(r.work / f"{name}.sock")
    if name == "decode":
        config = kv_config("decode", {"daemon": d.daemons["decode"].address,
                                      "attach_socket": sock})
    else:
        config = kv_config("prefill", {
            "daemon": d.daemons["prefill"].address, "attach_socket": sock,
            "decode_daemons": {f"127.0.0.1:{d.decode.port}": d.daemons["decode"].address}})
    new = vllm_serve(name, model, port=old.port, args=SERVE_ARGS, kv_transfer_config=config)
    if name == "decode":
        d.decode = new
    else:
        d.prefill = new
    new.wait_ready()
    return new


def _idle(d: Deployment) -> dict[str, float]:
    """What is still in use: live transfers per daemon, running requests and KV cache
    usage per server (all 0 when idle)."""
    out = {f"{n} daemon live": metric(d.metrics(n), "kvbeam_transfers_live")
           for n in ("prefill", "decode")}
    for s in (d.prefill, d.decode):
        url = s.url + "/metrics"
        out[f"{s.name} running"] = metric(url, "vllm:num_requests_running")
        out[f"{s.name} kv usage"] = metric(url, "vllm:kv_cache_usage_perc")
    return out


#: Tokens each request under load generates: long enough to be in flight at the kill.
LOAD_TOKENS = 48


def _load(url: str, seed: int, until: float) -> list[tuple[float, float, Completion | None, str]]:
    """Requests back to back until ``until`` (monotonic): (start, end, completion or None,
    why) each."""
    out = []
    i = 0
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            got: Completion | None = complete(url, _prompt(seed + i, 120), LOAD_TOKENS,
                                              timeout=END_BOUND_S)
            why = ""
        except OSError as exc:  # the bound passed (a hang), or the connection broke
            got, why = None, repr(exc)
        out.append((t0, time.monotonic(), got, why))
        i += 1
        if got is None or got.status != 200:
            time.sleep(0.1)  # refused at once while something is down: no busy loop
    return out


@pytest.mark.parametrize(("kind", "name"), [("daemon", "decode"), ("daemon", "prefill"),
                                            ("server", "decode"), ("server", "prefill")])
def test_a_kill_under_load_ends_every_request_and_leaves_nothing_in_use(
        recovery: Recovery, kind: str, name: str) -> None:
    d = recovery.deployment
    seed = {"decode": 3000, "prefill": 4000}[name] + (500 if kind == "server" else 0)
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(_load, d.router.url, seed + 100 * c, t0 + 6.0)
                   for c in range(4)]
        time.sleep(2.0)  # four clients sending back to back
        killed_at = time.monotonic()
        if kind == "daemon":
            d.daemons[name].kill()
        else:
            (d.decode if name == "decode" else d.prefill).kill()
        results = [r for f in clients for r in f.result()]
    spanning = [r for r in results if r[0] < killed_at < r[1]]
    statuses = sorted({str(got.status) if got else "none" for _s, _e, got, _w in results})
    print(f"\n{name} {kind} killed under load: {len(results)} requests, {len(spanning)} in "
          f"flight at the kill, statuses {statuses}, longest "
          f"{max(e - s for s, e, _g, _w in results):.1f} s")
    assert spanning, "no request was in flight when it was killed: the test proved nothing"
    for _s, _e, got, why in results:
        assert got is not None, f"a request did not end within {END_BOUND_S} s: {why}"
    if kind == "daemon":
        restarted = _restart(recovery, name)
        with KvbeamClient(restarted.address) as c:
            assert c.wait_healthy(120), restarted.output[-3000:]
    else:
        _restart_server(recovery, name)
        with KvbeamClient(d.daemons[name].address) as c:
            assert c.wait_healthy(120), d.daemons[name].output[-3000:]
    end = time.monotonic() + 120
    left = _idle(d)
    while any(left.values()) and time.monotonic() < end:
        time.sleep(1)
        left = _idle(d)
    assert not any(left.values()), left
    via, plain = _same_as_plain(d, _prompt(seed + 10))
    assert via.status == 200 and via.tokens == plain.tokens, (via, plain)
