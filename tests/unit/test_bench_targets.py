"""The target lines of ``make bench``: computed from a bench.json, printed, parsed back."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.bench import targets
from tests.bench.report import report

#: A `make bench` of 2026-11-29 (issue 8's sections only, no target lines of issue 14),
#: once docs/bench.json: kept here so the report of an old run stays readable.
OLD_RUN = Path(__file__).parent / "data" / "bench_issue8_2026-11-29.json"


def _row(tokens: int, nbytes: int, ms: float, integrity: bool = True,
         mode: str = "unified") -> dict[str, Any]:
    return {"mode": mode, "integrity": integrity, "tokens": tokens, "bytes": nbytes,
            "median_ms": ms, "best_ms": ms, "runs_ms": [ms], "gbps": nbytes * 8 / ms / 1e6,
            "prefill_cpu_ms": tokens / 1000, "decode_cpu_ms": tokens / 2000}


def _result() -> dict[str, Any]:
    """A full result: ib_write_bw 0.25 Gb/s, 4 KiB latency 100 us, round request times."""
    return {
        "device": "rxe0", "repeat": 3, "req_repeat": 5,
        "limits": {"ib_write_bw": {str(s): {"gbps": 0.25, "runs_gbps": [0.25]}
                                   for s in (4096, 65536, 1 << 20)},
                   "ib_write_lat": {str(s): {"t_typical_us": 100.0}
                                    for s in (4096, 65536, 1 << 20)}},
        "mooncake": {"65536": {"gbps": 0.2, "crc_ok": True}},
        "kvbeam_raw": {"65536": {"gbps": 0.3, "crc_ok": True}},
        "requests": [_row(128, 250_000, 24.0), _row(1024, 500_000, 50.0),
                     _row(8192, 2_500_000, 100.0), _row(32768, 10_000_000, 400.0),
                     _row(32768, 10_000_000, 320.0, integrity=False),
                     _row(32768, 10_000_000, 999.0, mode="paged")],
        "mooncake_request": {
            "slot": {"8192": {"median_ms": 90.0, "blocks": 33, "bytes": 2_500_000,
                              "crc_ok": True},
                     "32768": {"median_ms": 360.0, "blocks": 33, "bytes": 10_000_000,
                               "crc_ok": True}},
            "pages": {"32768": {"median_ms": 400.0, "blocks": 1176, "bytes": 10_000_000,
                                "crc_ok": True}}},
        "fragmented": [{"lists": "pages", "tokens": 32768, "bytes": 10_000_000,
                        "median_ms": 500.0, "runs_ms": [500.0]}],
        "aggregate": {"tokens": 8192, "concurrency": 16, "gbps": 0.225, "runs_gbps": [0.225]},
        "host_tcp": {"small_request_ms": 7.25, "requests": []},
        "engine_channel": {"cpu_ms": {"prefill": 12.5, "decode": 31.0},
                           "lines": {"engine_small_request_ms": 44.0}},
    }


def test_compute_every_target_from_its_sections() -> None:
    v = targets.compute(_result())
    assert v["ratio_vs_mooncake"] == pytest.approx(1.5)
    assert v["ratio_vs_ib_write_bw"] == pytest.approx(0.8)  # 10 MB in 400 ms = 0.2 Gb/s
    assert v["ratio_8k_vs_ib_write_bw"] == pytest.approx(0.8)
    # floor: 0.1 ms + 250 kB at 0.25 Gb/s (8 ms) = 8.1 ms
    assert v["small_request_x_floor"] == pytest.approx(24.0 / 8.1)
    assert v["integrity_overhead"] == pytest.approx(0.25)
    assert v["ratio_vs_mooncake_request"] == pytest.approx(0.9)
    assert v["ratio_8k_vs_mooncake_request"] == pytest.approx(0.9)
    assert v["ratio_vs_mooncake_request_pages"] == pytest.approx(0.8)
    assert math.isnan(v["ratio_vs_mooncake_request_engine"])  # no engine rows
    assert v["aggregate_16x8k_vs_ib_write_bw"] == pytest.approx(0.9)
    assert v["host_small_request_ms"] == pytest.approx(7.25)
    assert v["prefill_cpu_ms_per_request_32768"] == pytest.approx(32.768)
    assert v["decode_cpu_ms_per_request_1024"] == pytest.approx(0.512)
    assert v["engine_prefill_cpu_ms_128"] == pytest.approx(12.5)
    assert v["engine_decode_cpu_ms_128"] == pytest.approx(31.0)
    assert v["engine_small_request_ms_guest"] == pytest.approx(44.0)


def test_missing_sections_are_nan_not_errors() -> None:
    res = _result()
    for sec in ("mooncake_request", "fragmented", "aggregate", "host_tcp", "requests",
                "engine_channel"):
        del res[sec]
    v = targets.compute(res)
    assert v["ratio_vs_mooncake"] == pytest.approx(1.5)
    assert all(math.isnan(x) for k, x in v.items() if k != "ratio_vs_mooncake")
    assert set(v) == {t.name for t in targets.TARGETS}


def test_lines_round_trip_through_parse_and_ignore_other_text() -> None:
    v = targets.compute(_result())
    text = "\n".join(["some table", "x=1", *targets.lines(v), "ratio_vs_ib_write_bw=oops"])
    back = targets.parse(text)
    assert set(back) == {t.name for t in targets.TARGETS}
    for t in targets.TARGETS:
        if math.isnan(v[t.name]):
            assert math.isnan(back[t.name])
        else:
            assert back[t.name] == pytest.approx(v[t.name], abs=10 ** -t.digits)
    # Lines are bare name=value: the goals live in the table only.
    assert all("(" not in line and " " not in line for line in targets.lines(v))


def test_table_says_which_goals_are_met() -> None:
    rows = {line.split()[0]: line.split() for line in targets.table(targets.compute(_result()))}
    assert rows["ratio_vs_mooncake_request"][1:4] == ["0.90", ">=", "0.90"]
    assert rows["ratio_vs_mooncake_request"][4] == "yes"
    assert rows["ratio_vs_ib_write_bw"][4] == "NO"
    assert rows["small_request_x_floor"][2:5] == ["<=", "3.0", "yes"]
    assert rows["host_small_request_ms"][2:4] == ["-", "-"]
    assert rows["engine_prefill_cpu_ms_128"][2:5] == ["<=", "30.0", "yes"]
    assert rows["engine_decode_cpu_ms_128"][2:5] == ["<=", "30.0", "NO"]


def _printed(res: dict[str, Any]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report(res)
    return out.getvalue()


def test_report_ends_with_the_lines_of_a_full_run() -> None:
    res = _result()
    text = _printed(copy.deepcopy(res))
    tail = text.rstrip("\n").splitlines()[-len(targets.TARGETS):]
    assert tail == targets.lines(targets.compute(res))
    assert "Mooncake TE, one batch_transfer_sync_write" in text


def test_report_of_an_earlier_run_without_the_new_sections() -> None:
    res = json.loads(Path(OLD_RUN).read_text())
    back = targets.parse(_printed(res))
    assert back["ratio_vs_ib_write_bw"] == pytest.approx(res["ratio_vs_ib_write_bw"], abs=0.01)
    assert back["ratio_vs_mooncake"] == pytest.approx(res["ratio_vs_mooncake"], abs=0.01)
    assert math.isnan(back["ratio_vs_mooncake_request"])


def test_thread_groups_and_their_report() -> None:
    """Each daemon thread lands in the group its name says; the report prints each group
    of a bench.json's ``threads`` section with the daemon's total."""
    from tests.bench.bench_threads import group_of

    assert group_of("kvbeam-verbs-rxe0").startswith("verbs progress")
    assert group_of("kvbeam-io_1").startswith("executor")
    assert group_of("kvbeam-digest_0").startswith("digest pool")
    assert group_of("kvbeam-control_0").startswith("RPC handlers")
    assert group_of("Thread-1 (_serve)").startswith("gRPC Python server")
    assert group_of("[event_engine]").startswith("other threads (gRPC's C core")
    assert group_of("kvbeam-loop").startswith("daemon loop")
    # The kernel's 15-byte names (kvbeam/threads.py) land where py-spy's names do.
    for python, kernel in (("kvbeam-verbs-progress", "kvbeam-verbs-pr"),
                           ("kvbeam-io_0", "kvbeam-io_0")):
        assert group_of(python) == group_of(kernel) != "other", python
    assert group_of("kvbeam-peer_0").startswith("peer channel Abort pool")
    assert group_of("MainThread") == "other"
    res = _result()
    res["threads"] = {"128": {"prefill": {"executor (plan)": 12.5, "total": 20.0},
                              "decode": {"RPC handlers": 7.25, "total": 9.0},
                              "send_to_success_ms": {"median": 31.0}}}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report(res)
    text = out.getvalue()
    assert "CPU ms per 128-token request by thread group" in text and "31.0 ms" in text
    assert "prefill (20.0 ms): executor (plan) 12.5" in text
    assert "decode (9.0 ms): RPC handlers 7.2" in text
