"""sglang's own servers staged: the pool stays in sglang's tensors, behind sglang's router.

tests/host/test_sglang_server.py's setup (a tiny Llama with seeded weights, sglang's
prefill and decode servers with ``--disaggregation-transfer-backend kvbeam``, two
``--pools engine`` daemons without ``--config``, sglang's router), both servers with
``KVBEAM_STAGING=1``: sglang's KV pool and metadata rows stay in the tensors sglang
allocated (nothing moved into memfds, as on a GPU), and each backend attaches a host
staging buffer of the pools' geometry instead; prefill gathers a request's pages and
metadata row into it at the last chunk and sends from it, decode scatters the landed
items into sglang's pool before its poll says Success. The outputs through the router
must equal the plain server's (tests/host/conftest.py: once per session), one at a
time and several in flight, every transfer XXH3-128-verified by the decode daemon.

Negative control (the test harness, tests/sglang_server/harness, armed through a file):
the first page of a request overwritten in decode's staging items, after the landing
and before the scatter, changes the output.

Runs in the sglang server venv (``make test-sglang``); elsewhere it is skipped, and
KVBEAM_REQUIRE_SGLANG_SERVER=1 turns the skip into a failure.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.sglang_server_helpers import (
    IN_FLIGHT,
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
#: Each side's staging buffer: 4 requests of up to 1024 tokens (the prompts are <= 700).
STAGING_ENV = {"KVBEAM_STAGING": "1", "KVBEAM_STAGING_REQUESTS": "4",
               "KVBEAM_STAGING_TOKENS": "1024", "KVBEAM_STAGING_WAIT_S": "60"}


@dataclass
class StagedPair:
    work: Path
    plain: dict[tuple[int, int], list[int]]
    ports: dict[str, int]
    procs: dict[str, Process] = field(default_factory=dict)

    def arm(self, mode: str) -> None:
        """Arm the harness in the decode server for the next request."""
        (self.work / "arm").write_text(mode)


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory, sglang_plain: PlainOutputs
           ) -> Iterator[StagedPair]:
    work = tmp_path_factory.mktemp("sglang-staged")
    ports = {k: free_port() for k in ("pd", "dd", "prefill", "decode", "boot", "router")}
    pair = StagedPair(work, sglang_plain.outputs, ports)
    (work / "arm").write_text("")
    backend = ["--disaggregation-transfer-backend", "kvbeam",
               "--disaggregation-bootstrap-port", str(ports["boot"])]
    procs = pair.procs
    try:
        procs["prefill daemon"] = daemon("prefill", f"127.0.0.1:{ports['pd']}",
                                         work / "prefill.sock", work / "prefill-daemon.log")
        procs["decode daemon"] = daemon("decode", f"127.0.0.1:{ports['dd']}",
                                        work / "decode.sock", work / "decode-daemon.log")
        procs["prefill server"] = sglang_server(
            "prefill", sglang_plain.model, ports["prefill"], work / "prefill.log",
            "--disaggregation-mode", "prefill", *backend,
            env={"KVBEAM_DAEMON": f"127.0.0.1:{ports['pd']}",
                 "KVBEAM_ATTACH_SOCKET": str(work / "prefill.sock"), **STAGING_ENV})
        procs["prefill server"].wait_for("The server is fired up")
        procs["decode server"] = sglang_server(
            "decode", sglang_plain.model, ports["decode"], work / "decode.log",
            "--disaggregation-mode", "decode", *backend,
            "--disaggregation-decode-retraction-backup", "none",
            env={"KVBEAM_DAEMON": f"127.0.0.1:{ports['dd']}",
                 "KVBEAM_ATTACH_SOCKET": str(work / "decode.sock"),
                 "KVBEAM_TEST_ARM_FILE": str(work / "arm"), **STAGING_ENV},
            path=(HARNESS,))
        procs["decode server"].wait_for("The server is fired up")
        procs["router"] = router(ports["router"], f"http://127.0.0.1:{ports['prefill']}",
                                 ports["boot"], f"http://127.0.0.1:{ports['decode']}",
                                 work / "router.log")
        procs["router"].wait_listening(ports["router"])
        print("\nstart-up (s): " + ", ".join(f"{k} {p.ready_s:.0f}" for k, p in procs.items()
                                              if p.ready_s is not None))
        yield pair
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def _memfds(proc: Process) -> set[str]:
    """The memfd names a server's process group maps (sglang's scheduler among them)."""
    names: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != proc.proc.pid:
                continue
            names |= set(re.findall(r"memfd:(\S+)", (entry / "maps").read_text()))
        except (OSError, ProcessLookupError):
            continue
    return names


def _verified(pair: StagedPair) -> int:
    """Requests the decode daemon verified (XXH3-128) so far."""
    log = pair.procs["decode daemon"].text()
    return sum(": Success (" in line and "XXH3-128 verified" in line
               for line in log.splitlines())


def test_the_pool_stays_in_sglangs_tensors_and_a_staging_buffer_is_attached(
        staged: StagedPair) -> None:
    """Each backend described its pools from sglang's objects (as unstaged), kept them
    where sglang allocated them (no ``kvbeam.sglang.kv`` or ``kvbeam.sglang.aux`` memfd
    in the server's processes) and attached a staging buffer (its memfds mapped, the
    daemon attached with the pools' model)."""
    for server in ("prefill server", "decode server"):
        text = staged.procs[server].text()
        assert described_pools(staged.procs[server]) == [side_config(aux_rows=2 * MAX_RUNNING)]
        assert "the pools stay on cpu; staged through a host buffer of 4 request(s)" in text
        assert "sglang KV pool (2 K and 2 V buffers) stays on cpu (staged)" in text
        names = _memfds(staged.procs[server])
        print(f"\n{server} maps memfds {sorted(names)}")
        assert not any(n.startswith(("kvbeam.sglang.kv", "kvbeam.sglang.aux")) for n in names)
        assert any(n.startswith("kvbeam.") for n in names), names
    for name in ("prefill daemon", "decode daemon"):
        assert "attached: tiny-llama" in staged.procs[name].text(), name


def test_staged_router_outputs_equal_one_plain_server(staged: StagedPair) -> None:
    before = _verified(staged)
    rows = []
    for n in LENGTHS:
        t0 = time.monotonic()
        got = generate(staged.ports["router"], prompt(n), NEW_TOKENS).get("output_ids")
        rows.append(f"{n}: {'equal' if got == staged.plain[(n, 0)] else 'DIFFERENT'} "
                    f"{1e3 * (time.monotonic() - t0):.0f} ms")
        assert got == staged.plain[(n, 0)], n
    print(f"\nstaged, through the router ({NEW_TOKENS} tokens): " + ", ".join(rows))
    assert _verified(staged) - before == len(LENGTHS)


def test_staged_requests_in_flight_equal_the_plain_server(staged: StagedPair) -> None:
    got: dict[tuple[int, int], object] = {}

    def one(key: tuple[int, int]) -> None:
        got[key] = generate(staged.ports["router"], prompt(*key), NEW_TOKENS).get("output_ids")

    threads = [threading.Thread(target=one, args=(k,)) for k in IN_FLIGHT]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert {k: got.get(k) for k in IN_FLIGHT} == {k: staged.plain[k] for k in IN_FLIGHT}


def test_a_corrupted_staging_item_changes_the_output(staged: StagedPair) -> None:
    """The first page of the request overwritten in decode's staging items after the
    landing, before the scatter: the output changes (decode decodes what it scattered)."""
    staged.arm("staged")
    out = generate(staged.ports["router"], prompt(300), NEW_TOKENS)
    print(f"\nstaged block corrupted: {out.get('output_ids')} (plain {staged.plain[(300, 0)]})")
    assert "HARNESS: corrupted the staged block" in staged.procs["decode server"].text()
    assert out.get("output_ids") != staged.plain[(300, 0)], out
    assert generate(staged.ports["router"], prompt(100), NEW_TOKENS).get(
        "output_ids") == staged.plain[(100, 0)]


def test_the_staging_figures_are_in_sglangs_log(staged: StagedPair) -> None:
    """Each server logs its staging buffer's figures (requests, bytes and copy time each
    way, waits, refusals, occupancy) at most every 10 s while requests move."""
    time.sleep(11)  # past the last line's interval: the next request's polls log one
    assert generate(staged.ports["router"], prompt(6), NEW_TOKENS).get(
        "output_ids") == staged.plain[(6, 0)]
    for server, role, moved in (("prefill server", "prefill", "gathered"),
                                ("decode server", "decode", "scattered")):
        lines = [line for line in staged.procs[server].text().splitlines()
                 if f"kvbeam staging ({role}):" in line]
        print(f"\n{server}: {lines[-1] if lines else None}")
        counts = [int(m.group(1)) for line in lines
                  if (m := re.search(rf"(\d+) (?:request\(s\) )?{moved}", line))]
        assert counts and max(counts) >= len(LENGTHS), lines
