"""sglang's own servers with ``--disaggregation-transfer-backend kvbeam``, behind its router.

One plain sglang server records greedy outputs (tests/host/conftest.py, once per
session); then two ``--pools engine`` kvbeam daemons, sglang's prefill and decode
servers (the backend installs itself through its plugin entry point) and sglang's
router (``--pd-disaggregation --mini-lb``), started one after the other (an idle sglang
scheduler busy-polls a core). Through the router
the outputs must equal the plain server's for prompts under and over one chunk
(``--chunked-prefill-size``), one at a time and several in flight; every transfer is
XXH3-128-verified by the decode daemon. A tiny Llama with seeded weights (with sglang's
dummy weights the output is a 2-token cycle that ignores the context).

The daemons run without ``--config`` and the servers without ``KVBEAM_CONFIG``: each
backend reads its pools' description from sglang's own pool objects and attaches with
it (checked here against what the test knows of the model). A decode server with
another ``--kv-cache-dtype`` is refused per request, naming both dtypes and the flag, at
the client; nothing moves.

Negative control (the test harness, tests/sglang_server/harness): a moved block
overwritten on decode changes the output; a moved metadata row with another bootstrap
room fails the request (sglang's own check). An aborted request frees its pages on both
servers. The commands are docs/sglang.md's.

Runs in the sglang server venv (``make test-sglang``); elsewhere it is skipped, and
KVBEAM_REQUIRE_SGLANG_SERVER=1 turns the skip into a failure.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.sglang_server_helpers import (
    CHUNK,
    IN_FLIGHT,
    KV_DTYPE,
    LENGTHS,
    MAX_RUNNING,
    NEW_TOKENS,
    ROOT,
    PlainOutputs,
    Process,
    daemon,
    described_pools,
    free_port,
    generate,
    prompt,
    require_sglang_server,
    router,
    sglang_server,
    side_config,
)

pytestmark = require_sglang_server()

HARNESS = ROOT / "tests" / "sglang_server" / "harness"


def _post(port: int, path: str, body: dict[str, object]) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return int(resp.status)


def _load(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/loads", timeout=60) as resp:
        out: dict[str, object] = json.loads(resp.read())["loads"][0]
    return out


@dataclass
class Served:
    """The running pair and what the plain server produced."""

    work: Path
    plain: dict[tuple[int, int], list[int]]
    ports: dict[str, int]
    procs: dict[str, Process] = field(default_factory=dict)
    starts: dict[str, float] = field(default_factory=dict)
    model: str = ""

    def arm(self, mode: str) -> None:
        """Arm the harness in the decode server for the next request."""
        (self.work / "arm").write_text(mode)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, sglang_plain: PlainOutputs
           ) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("sglang-served")
    model = sglang_plain.model
    ports = {k: free_port() for k in ("pd", "dd", "prefill", "decode", "boot", "router")}
    starts: dict[str, float] = {"plain server": sglang_plain.ready_s}
    served = Served(work, sglang_plain.outputs, ports, starts=starts)
    (work / "arm").write_text("")
    served.model = model
    backend = ["--disaggregation-transfer-backend", "kvbeam",
               "--disaggregation-bootstrap-port", str(ports["boot"])]
    procs = served.procs
    try:
        procs["prefill daemon"] = daemon("prefill", f"127.0.0.1:{ports['pd']}",
                                         work / "prefill.sock", work / "prefill-daemon.log")
        procs["decode daemon"] = daemon("decode", f"127.0.0.1:{ports['dd']}",
                                        work / "decode.sock", work / "decode-daemon.log")
        procs["prefill server"] = sglang_server(
            "prefill", model, ports["prefill"], work / "prefill.log",
            "--disaggregation-mode", "prefill", *backend,
            env={"KVBEAM_DAEMON": f"127.0.0.1:{ports['pd']}",
                 "KVBEAM_ATTACH_SOCKET": str(work / "prefill.sock")})
        procs["prefill server"].wait_for("The server is fired up")
        procs["decode server"] = sglang_server(
            "decode", model, ports["decode"], work / "decode.log",
            "--disaggregation-mode", "decode", *backend,
            "--disaggregation-decode-retraction-backup", "none",
            env={"KVBEAM_DAEMON": f"127.0.0.1:{ports['dd']}",
                 "KVBEAM_ATTACH_SOCKET": str(work / "decode.sock"),
                 "KVBEAM_TEST_ARM_FILE": str(work / "arm")}, path=(HARNESS,))
        procs["decode server"].wait_for("The server is fired up")
        procs["router"] = router(ports["router"], f"http://127.0.0.1:{ports['prefill']}",
                                 ports["boot"], f"http://127.0.0.1:{ports['decode']}",
                                 work / "router.log")
        procs["router"].wait_listening(ports["router"])
        for name, p in procs.items():
            if p.ready_s is not None:  # the daemons are ready once their server attached
                starts[name] = p.ready_s
        print("\nstart-up (s): " + ", ".join(f"{k} {v:.0f}" for k, v in starts.items()))
        yield served
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def test_each_backend_read_its_pools_from_sglang(served: Served) -> None:
    """No side YAML anywhere: each server's backend described its pools from sglang's
    own objects, as the test knows them (the tiny Llama's layers, heads, head dim, KV
    dtype, sglang's token rows and metadata rows), and its daemon took that description
    with the attach."""
    want = side_config(aux_rows=2 * MAX_RUNNING)
    for server in ("prefill server", "decode server"):
        got = described_pools(served.procs[server])
        print(f"\n{server}: {json.dumps(got)}")
        assert got == [want], served.procs[server].text()[-3000:]
    for name in ("prefill daemon", "decode daemon"):
        assert "attached: tiny-llama" in served.procs[name].text(), name


def _verified(served: Served) -> int:
    """Requests the decode daemon verified (XXH3-128) so far."""
    log = served.procs["decode daemon"].text()
    # Its step lines (": Success (", --log-requests), not the end lines that repeat it.
    return sum(": Success (" in line and "XXH3-128 verified" in line
               for line in log.splitlines())


def _chunks_posted(served: Served) -> int:
    """Non-final chunks the prefill daemon wrote so far (each as sglang handed it over)."""
    log = served.procs["prefill daemon"].text()
    return sum(": posted chunk, " in line for line in log.splitlines())


def test_router_outputs_equal_one_plain_server(served: Served) -> None:
    rows = ["| prompt tokens | chunks | tokens compared | in flight | result |",
            "|---|---|---|---|---|"]
    before = _verified(served)
    chunks_before = _chunks_posted(served)
    took = []
    for n in LENGTHS:
        t0 = time.monotonic()
        out = generate(served.ports["router"], prompt(n), NEW_TOKENS)
        took.append(f"{n}: {1e3 * (time.monotonic() - t0):.0f} ms")
        got = out.get("output_ids")
        rows.append(f"| {n} | {-(-n // CHUNK)} | {NEW_TOKENS} | 1 | "
                    f"{'equal' if got == served.plain[(n, 0)] else 'DIFFERENT'} |")
        assert got == served.plain[(n, 0)], (n, out)
    print("\n" + "\n".join(rows))
    print(f"request times through the router ({NEW_TOKENS} tokens): {', '.join(took)}")
    assert _verified(served) - before == len(LENGTHS)
    # Prompts over one chunk moved chunk by chunk: each earlier chunk was written when
    # sglang handed it over, before the last (300: one, 700: two).
    early = sum(-(-n // CHUNK) - 1 for n in LENGTHS)
    assert _chunks_posted(served) - chunks_before >= early, served.procs[
        "prefill daemon"].text()[-4000:]
    # By default (KVBEAM_STREAM_CHUNKS unset), as the prefill server logged at start.
    assert "each chunk sent as sglang hands it over (KVBEAM_STREAM_CHUNKS on)" in \
        served.procs["prefill server"].text()
    # The backend's managers asked to be pushed only each request's end.
    for name in ("prefill daemon", "decode daemon"):
        assert "(pushes: final)" in served.procs[name].text(), name


def test_several_requests_in_flight_equal_the_plain_server(served: Served) -> None:
    keys = list(IN_FLIGHT)
    got: dict[tuple[int, int], object] = {}

    def one(key: tuple[int, int]) -> None:
        got[key] = generate(served.ports["router"], prompt(*key), NEW_TOKENS).get("output_ids")

    threads = [threading.Thread(target=one, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    print(f"\n{len(keys)} in flight (prompts {[k[0] for k in keys]}): "
          f"{sum(got[k] == served.plain[k] for k in keys)} equal")
    assert {k: got.get(k) for k in keys} == {k: served.plain[k] for k in keys}


def test_a_corrupted_moved_block_changes_the_output(served: Served) -> None:
    served.arm("block")
    out = generate(served.ports["router"], prompt(300), NEW_TOKENS)
    print(f"\nblock corrupted: {out.get('output_ids')} (plain {served.plain[(300, 0)]})")
    assert "HARNESS: corrupted the moved block" in served.procs["decode server"].text()
    assert out.get("output_ids") != served.plain[(300, 0)], out
    # The next request is clean again: the corruption was this request's only.
    assert generate(served.ports["router"], prompt(100), NEW_TOKENS).get(
        "output_ids") == served.plain[(100, 0)]


def test_a_corrupted_metadata_row_fails_the_request(served: Served) -> None:
    served.arm("row")
    out = generate(served.ports["router"], prompt(100), NEW_TOKENS)
    print(f"\nmetadata row corrupted: {json.dumps(out)[:300]}")
    assert "HARNESS: corrupted the moved row" in served.procs["decode server"].text()
    assert out.get("output_ids") != served.plain[(100, 0)], out
    assert "bootstrap_room mismatch" in json.dumps(out) or "error" in out, out
    assert "Context corruption detected" in served.procs["decode server"].text()


def test_an_aborted_request_frees_its_pages_on_both_servers(served: Served) -> None:
    ports = served.ports
    result: dict[str, object] = {}

    def long() -> None:
        result.update(generate(ports["router"], prompt(300, 9), 1500))

    t = threading.Thread(target=long)
    t.start()
    deadline = time.monotonic() + 120
    while int(_load(ports["decode"]).get("num_running_reqs", 0)) == 0:  # type: ignore[call-overload]
        assert time.monotonic() < deadline, "the long request never reached decode"
        time.sleep(0.2)
    busy = _load(ports["decode"])
    for server in ("prefill", "decode"):
        assert _post(ports[server], "/abort_request", {"abort_all": True}) == 200
    t.join(120)
    assert not t.is_alive()
    print(f"\naborted after {len(result.get('output_ids', []))} tokens: "  # type: ignore[arg-type]
          f"{json.dumps(result.get('meta_info', result))[:200]}")
    assert "abort" in json.dumps(result).lower(), result
    assert len(result.get("output_ids", [])) < 1500, result  # type: ignore[arg-type]
    # Idle again: nothing running or queued, and each server's pool empties once its
    # cache is flushed (sglang refuses /flush_cache while a request holds pages).
    deadline = time.monotonic() + 60
    for server in ("prefill", "decode"):
        while int(_load(ports[server]).get("num_running_reqs", 0)) != 0:  # type: ignore[call-overload]
            assert time.monotonic() < deadline, _load(ports[server])
            time.sleep(0.2)
        assert _post(ports[server], "/flush_cache", {}) == 200
        load = _load(ports[server])
        print(f"\n{server} after abort: {load.get('num_used_tokens')} tokens used "
              f"(decode while busy: {busy.get('num_used_tokens')})")
        assert int(load.get("num_used_tokens", -1)) == 0, load  # type: ignore[call-overload]
    assert int(busy.get("num_used_tokens", 0)) >= 300  # type: ignore[call-overload]
    # And the pair still serves the plain server's output.
    assert generate(ports["router"], prompt(6), NEW_TOKENS).get("output_ids") == \
        served.plain[(6, 0)]


#: The mismatched decode server's KV cache dtype (``--kv-cache-dtype``): the same item
#: length as prefill's float16, so only the description tells them apart (the issue's
#: case: HTTP 200 and wrong output, every transfer "verified").
MISMATCHED_DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def mismatched(served: Served) -> Iterator[dict[str, Process]]:
    """A second decode server with ``--kv-cache-dtype bfloat16`` and its daemon, and a
    second router over the running prefill server and it."""
    work, ports = served.work, served.ports
    mine = {k: free_port() for k in ("dd", "decode", "router")}
    procs: dict[str, Process] = {}
    try:
        procs["daemon"] = daemon("decode", f"127.0.0.1:{mine['dd']}", work / "bf16.sock",
                                 work / "bf16-daemon.log", name="kvbeam decode (bf16)")
        procs["decode"] = sglang_server(
            "decode (bf16)", served.model, mine["decode"], work / "bf16-decode.log",
            "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvbeam",
            "--disaggregation-bootstrap-port", str(ports["boot"]),
            "--disaggregation-decode-retraction-backup", "none",
            "--kv-cache-dtype", MISMATCHED_DTYPE,
            env={"KVBEAM_DAEMON": f"127.0.0.1:{mine['dd']}",
                 "KVBEAM_ATTACH_SOCKET": str(work / "bf16.sock")})
        procs["decode"].wait_for("The server is fired up")
        procs["router"] = router(mine["router"], f"http://127.0.0.1:{ports['prefill']}",
                                 ports["boot"], f"http://127.0.0.1:{mine['decode']}",
                                 work / "bf16-router.log")
        procs["router"].wait_listening(mine["router"])
        served.ports["mismatched router"] = mine["router"]
        yield procs
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def test_a_dtype_mismatch_is_refused_naming_both(served: Served,
                                                 mismatched: dict[str, Process]) -> None:
    """Prefill's KV cache is float16, the mismatched decode server's bfloat16: the
    request fails at once, at the client, naming both dtypes and the flag; nothing moves
    (before: HTTP 200 and wrong output). The pair itself still serves."""
    assert described_pools(mismatched["decode"]) == [
        side_config(aux_rows=2 * MAX_RUNNING, dtype=MISMATCHED_DTYPE)]
    logs = {"decode": mismatched["decode"], "prefill": served.procs["prefill server"]}
    since = {side: len(proc.text()) for side, proc in logs.items()}
    started = time.monotonic()
    try:
        out = generate(served.ports["mismatched router"], prompt(100), NEW_TOKENS, timeout=120)
    except TimeoutError:
        pytest.fail("no answer within 120 s: the mismatch was not refused at once")
    text = json.dumps(out)
    print(f"\nmismatched dtype, after {time.monotonic() - started:.1f} s: {text[:600]}")
    assert "output_ids" not in out and out.get("error") == 500, out
    named = f"dtype: prefill={KV_DTYPE}, decode={MISMATCHED_DTYPE} (--kv-cache-dtype"
    assert named in text, text
    # Both servers logged the cause (prefill from decode's word in the room); neither
    # daemon saw the request (nothing reserved). At once, not at a deadline: sglang's
    # (300 s) would fail it naming SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (or, once
    # reserved, _WAITING_TIMEOUT), on either server.
    said = {side: proc.text()[since[side]:] for side, proc in logs.items()}
    for side in logs:
        assert named in said[side], (side, said[side][-3000:])
        assert "SGLANG_DISAGGREGATION_" not in said[side], (side, said[side][-3000:])
    assert "SGLANG_DISAGGREGATION_" not in text, text
    assert re.search(r"sglang-\d", mismatched["daemon"].text()) is None  # no request id
    # Negative control: the matching pair still gives the plain server's output.
    assert generate(served.ports["router"], prompt(100), NEW_TOKENS).get(
        "output_ids") == served.plain[(100, 0)]
