"""Metrics and structured logs of real daemons (separate processes, TCP on loopback).

The scrapes check that counters move by exactly one request's worth: its bytes
(the plan's byte total, as both daemons report it; the transport's also count its
digest record), its blocks (as prefill's ``posted`` lines report them, and the
record's), one Success, one latency observation.
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import pytest

from kvbeam.errors import DaemonStartError, DuplicateRequest, UnknownRequest
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.mailbox import record_size
from kvbeam.pools.spec import load_side_config
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import run_request
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import pair, start
from tests.fixtures import shipped_config
from tests.metrics_helpers import (
    delta,
    scrape,
    settle,
    succeeded_once_more,
    value,
)
from tests.waiting import wait_until

S, F = TransferState.SUCCESS, TransferState.FAILED
METRICS = ["--metrics", "127.0.0.1:0"]


def posted_blocks(prefill: DaemonProcess, rid: str, chunks: int) -> int:
    """Blocks prefill reported posting for a request's ``chunks`` chunks (its plan's blocks).

    Waits for the lines: the daemon's output reaches this process through a pipe and
    a reader thread, possibly after the scrape that already counted the blocks.
    """
    pattern = re.compile(rf"request {re.escape(rid)}: posted .*?(\d+) bytes in (\d+) blocks")
    assert wait_until(lambda: len(pattern.findall(prefill.output)) == chunks, 10), \
        prefill.output
    return sum(int(m.group(2)) for m in pattern.finditer(prefill.output))


def test_metrics_move_by_exactly_one_request() -> None:
    with pair(decode_extra=METRICS, prefill_extra=METRICS) as (prefill, decode, p, d):
        assert prefill.metrics and decode.metrics
        p0, d0 = scrape(prefill.metrics), scrape(decode.metrics)
        assert value(d0, "kvbeam_slots") == 16 and value(d0, "kvbeam_slots_reserved") == 0

        d.reserve("m-1", 3000, prefill.address)
        d1 = scrape(decode.metrics)
        assert delta(d1, d0, "kvbeam_slots_reserved") == 1
        assert value(d1, "kvbeam_transfers_live", state="Bootstrapping") == 1
        assert delta(d1, d0, "kvbeam_transfers_started_total") == 1

        # During the transfer: a first chunk landed, the request is still Transferring.
        p.send("m-1", 2, 3000, decode.address, final=False, chunks=[(0, 1024)])

        def chunk_done() -> bool:
            st = p.status("m-1")
            return st.bytes_total > 0 and st.bytes_done == st.bytes_total

        assert wait_until(chunk_done, 10)
        chunk = p.status("m-1").bytes_total
        pm = settle(prefill.metrics,
                    lambda s: delta(s, p0, "kvbeam_transport_sent_bytes_total") > 0)
        dm = scrape(decode.metrics)
        assert delta(pm, p0, "kvbeam_transport_sent_bytes_total") == chunk
        assert delta(dm, d0, "kvbeam_transport_received_bytes_total") == chunk
        assert value(pm, "kvbeam_transfers_live", state="Transferring") == 1
        assert value(dm, "kvbeam_transfers_live", state="Transferring") == 1
        assert delta(dm, d0, "kvbeam_transfers_total", state="Success", reason="none") == 0
        assert value(pm, "kvbeam_peers") == 1 and value(pm, "kvbeam_transport_links") == 1

        p.send("m-1", 2, 3000, decode.address, final=True)
        assert d.wait("m-1", 20).state is S
        assert p.wait("m-1", 10).state is S
        # Decode keeps the books until Release (prefill forgets them soon after Success),
        # so its figure is the plan's byte total; prefill's counters must match it below.
        total = d.status("m-1").bytes_total
        assert total > chunk

        p2 = settle(prefill.metrics, succeeded_once_more(p0))
        d2 = settle(decode.metrics, succeeded_once_more(d0))
        for after, before, role in ((p2, p0, "prefill"), (d2, d0, "decode")):
            assert delta(after, before, "kvbeam_transfers_total", state="Success",
                         reason="none") == 1, role
            assert delta(after, before, "kvbeam_transfer_seconds_count", state="Success") == 1
            assert delta(after, before, "kvbeam_request_bytes_total") == total, role
            assert sum(delta(after, before, "kvbeam_transfers_total", state="Failed",
                             reason=r.value) for r in FailureReason) == 0, role
            assert value(after, "kvbeam_transfers_live", state="Transferring") == 0
        # The wire also carried the request's digest record (protocol 5): the last block of
        # the final write (its digests ran inline, a small request's: one write).
        record = record_size(len(build_side_layout(
            load_side_config(shipped_config("prefill"))).flat_buffers))
        assert delta(p2, p0, "kvbeam_transport_sent_bytes_total") == total + record
        blocks = posted_blocks(prefill, "m-1", chunks=2)
        assert delta(p2, p0, "kvbeam_transport_sent_blocks_total") == blocks + 1
        assert delta(p2, p0, "kvbeam_transport_write_completions_total", status="OK") == 2
        assert value(p2, "kvbeam_transport_inflight_writes") == 0
        assert delta(d2, d0, "kvbeam_transport_received_bytes_total") == total + record
        assert delta(d2, d0, "kvbeam_transport_notifications_total") == 1
        assert delta(p2, p0, "kvbeam_handshakes_total", side="client", result="ok") == 1
        assert delta(p2, p0, "kvbeam_handshake_seconds_count", side="client") == 1
        assert delta(d2, d0, "kvbeam_handshakes_total", side="server", result="ok") == 1
        assert delta(d2, d0, "kvbeam_slots_reserved") == 1  # held until Release

        d.release("m-1")
        assert value(scrape(decode.metrics), "kvbeam_slots_reserved") == 0

        # An abort: its reason is counted once, and the slot comes back.
        d.reserve("m-2", 100, prefill.address)
        assert value(scrape(decode.metrics), "kvbeam_slots_reserved") == 1
        assert d.abort("m-2").reason is FailureReason.ABORTED
        d3 = settle(decode.metrics, lambda s: value(s, "kvbeam_slots_reserved") == 0)
        assert delta(d3, d2, "kvbeam_transfers_total", state="Failed", reason="aborted") == 1
        assert delta(d3, d2, "kvbeam_transfer_seconds_count", state="Failed") == 1
        assert delta(d3, d2, "kvbeam_transfers_total", state="Success", reason="none") == 0
        assert delta(d3, d2, "kvbeam_request_bytes_total") == 0

        # Refused RPCs, by method and code.
        with pytest.raises(DuplicateRequest):
            d.reserve("m-1", 100, prefill.address)
        with pytest.raises(UnknownRequest):
            d.status("never-seen")
        d4 = scrape(decode.metrics)
        assert delta(d4, d3, "kvbeam_rpc_refusals_total", method="Reserve",
                     code="ALREADY_EXISTS") == 1
        assert delta(d4, d3, "kvbeam_rpc_refusals_total", method="Status", code="NOT_FOUND") == 1


def json_lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_json_logs_name_the_request_and_peer_on_every_request_line() -> None:
    with pair(decode_extra=["--log-format", "json"]) as (prefill, decode, p, d):
        assert run_request(p, d, "j-1", 700, 0).ok
        with pytest.raises(Exception, match="already known"):
            d.reserve("j-1", 700, prefill.address)
        d.reserve("j-2", 10, prefill.address)
        d.abort("j-2", "test abort")

        def logged() -> bool:
            return ("slot 0 freed (aborted" in decode.output
                    or "j-2: slot" in decode.output) and "Success" in prefill.output

        assert wait_until(logged, 10)
        records = json_lines(decode.output)
        assert records, decode.output
        for rec in records:
            assert {"timestamp", "level", "logger", "message", "role", "request_id",
                    "peer"} <= set(rec)
            assert rec["role"] == "decode"
        about = [r for r in records if re.search(r"\bj-[12]\b", r["message"])]
        assert len(about) >= 5, about  # reserved, Success, freed, refused, aborted, freed
        for rec in about:
            rid = re.search(r"\b(j-[12])\b", rec["message"])
            assert rid is not None
            assert rec["request_id"] == rid.group(1), rec
            assert rec["peer"] == prefill.address, rec
        refused = [r for r in about if r["message"].startswith("Reserve refused")]
        assert refused and refused[0]["level"] == "INFO"
        # No decode log line escaped the JSON format (the ready line is stdout, not a log).
        text_logs = [line for line in decode.output.splitlines()
                     if re.match(r"\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ ", line)]
        assert not text_logs, text_logs

        # prefill logs text: request lines end with the same fields
        text = [line for line in prefill.output.splitlines() if "request j-1:" in line]
        assert text and all(line.endswith(f"request=j-1 peer={decode.address}")
                            for line in text), text


#: Prefill's and decode's lines about a request that went well (``--log-requests``).
PROGRESS = ("reserved slot", ": posted ", ": Success (", "freed (")


def test_a_request_that_goes_well_logs_one_line_by_default() -> None:
    """The daemons' default (``--log-requests`` off; the tests' environment turns it on):
    a Success logs one line about its request on each side, its end (kvbeam.transfers:
    bytes, ms, verification), none of its steps; a failure logs its end with the cause,
    and its WARNING. With ``--log-ends-per-s 0`` a Success logs nothing."""
    quiet = {"KVBEAM_LOG_REQUESTS": "false"}
    with pair(prefill_env=quiet, decode_env=quiet) as (prefill, decode, p, d):
        result = run_request(p, d, "q-1", 700, 0)
        assert result.ok and result.verified, result
        d.reserve("q-2", 10, prefill.address)
        d.abort("q-2", "test abort")  # an abort is logged whatever the setting
        assert wait_until(lambda: "q-2 aborted by the scheduler" in decode.output, 10), \
            decode.output
        ends = {"prefill": r"request q-1: Success, (\d+)/\1 bytes written in [\d.]+ ms; "
                           r"XXH3-128 digests of \d+ buffers go with its last write",
                "decode": r"request q-1: Success, (\d+)/\1 bytes landed in [\d.]+ ms; "
                          r"XXH3-128 verified: \d+ buffers match prefill's digests"}
        for daemon in (prefill, decode):
            assert wait_until(lambda dp=daemon: "request q-1: Success" in dp.output, 10), \
                daemon.output  # the sweep writes it, within 0.2 s
            lines = [line for line in daemon.output.splitlines() if "q-1" in line]
            assert len(lines) == 1 and " INFO kvbeam.transfers: " in lines[0], lines
            assert re.search(ends[daemon.role], lines[0]), lines[0]
            assert not any(p in daemon.output for p in PROGRESS), daemon.output
        assert wait_until(lambda: "request q-2: Failed (aborted: " in decode.output, 10), \
            decode.output
    off = {**quiet, "KVBEAM_LOG_ENDS_PER_S": "0"}
    with pair(prefill_env=off, decode_env=off) as (prefill, decode, p, d):
        result = run_request(p, d, "q-3", 700, 0)
        assert result.ok and result.verified, result
    for daemon in (prefill, decode):  # stopped: every line is in
        assert not [line for line in daemon.output.splitlines() if "q-3" in line], \
            daemon.output


def test_metrics_port_in_use_stops_the_daemon_with_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DaemonStartError) as info:
            start("decode", extra=["--metrics", f"127.0.0.1:{port}"])
    out = info.value.output
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in out
    assert "exit code 2" in str(info.value)
