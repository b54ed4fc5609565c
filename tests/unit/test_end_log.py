"""The one line per ended transfer (server/end_log.py): its words and its rate limit."""

from __future__ import annotations

import logging

import pytest

from kvbeam.errors import ConfigError
from kvbeam.logs import END_LOGGER
from kvbeam.server.end_log import SUMMARY_S, EndLog
from kvbeam.server.settings import resolve
from kvbeam.states import FailureReason, TransferFacts, TransferState, TransferStatus
from tests.fake_clock import FakeClock


def _snap(rid: str, state: TransferState, reason: FailureReason | None = None,
          detail: str = "") -> TransferStatus:
    return TransferStatus(rid, "127.0.0.1:9", state, reason, detail, 3, 0.0123)


def _facts(rid: str) -> TransferFacts:
    return TransferFacts(4096 if rid.startswith("ok") else 0, 4096, (("KV_PAGES", 2),), 0,
                         "XXH3-128 verified: 3 buffers match prefill's digests")


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == END_LOGGER]


def test_a_success_and_a_failure_each_get_one_line_with_bytes_ms_and_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    log = EndLog(10, _facts, "landed", clock)
    log.ended(_snap("ok-1", TransferState.TRANSFERRING))  # not an end: no line
    log.ended(_snap("ok-1", TransferState.SUCCESS))
    log.ended(_snap("bad-1", TransferState.FAILED, FailureReason.TIMEOUT,
                    "no progress in Bootstrapping for 10.0 s"))
    with caplog.at_level(logging.INFO, END_LOGGER):
        log.flush()
    assert _lines(caplog) == [
        "request ok-1: Success, 4096/4096 bytes landed in 12.3 ms; "
        "XXH3-128 verified: 3 buffers match prefill's digests",
        "request bad-1: Failed (timeout: no progress in Bootstrapping for 10.0 s), "
        "0/4096 bytes landed in 12.3 ms; XXH3-128 verified: 3 buffers match prefill's digests"]
    assert [(r.request_id, r.peer) for r in caplog.records] == [  # type: ignore[attr-defined]
        ("ok-1", "127.0.0.1:9"), ("bad-1", "127.0.0.1:9")]


def test_past_the_rate_ends_are_counted_and_summed_up_every_summary_period(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    log = EndLog(2, _facts, "written", clock)
    with caplog.at_level(logging.INFO, END_LOGGER):
        for i in range(5):  # a burst: the bucket holds one second's lines (2)
            log.ended(_snap(f"ok-{i}", TransferState.SUCCESS))
        log.ended(_snap("bad", TransferState.FAILED, FailureReason.ABORTED, "by the test"))
        log.flush()
        assert [line.split(":")[0] for line in _lines(caplog)] == ["request ok-0",
                                                                   "request ok-1"]
        clock.now += 1.0  # two more tokens
        log.ended(_snap("ok-5", TransferState.SUCCESS))
        log.flush()
        assert _lines(caplog)[-1].startswith("request ok-5: Success")
        assert not any("more transfer" in line for line in _lines(caplog))  # not due yet
        clock.now += SUMMARY_S
        log.flush()
        summary = _lines(caplog)[-1]
    assert summary.startswith("4 more transfer(s) ended in the last 11 s, not logged one by "
                              "one (3 Success, 1 Failed): at most 2 lines a second"), summary
    caplog.clear()
    with caplog.at_level(logging.INFO, END_LOGGER):
        clock.now += SUMMARY_S
        log.flush()  # nothing skipped since: no summary
        assert _lines(caplog) == []
        log.ended(_snap("ok-6", TransferState.SUCCESS))
        log.flush()
    assert _lines(caplog)[0].startswith("request ok-6: Success")


def test_the_daemons_stop_sums_up_at_once_and_zero_logs_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    log = EndLog(1, _facts, "landed", clock)
    off = EndLog(0, _facts, "landed", clock)
    with caplog.at_level(logging.INFO, END_LOGGER):
        for i in range(3):
            log.ended(_snap(f"ok-{i}", TransferState.SUCCESS))
            off.ended(_snap(f"off-{i}", TransferState.SUCCESS))
        off.flush(final=True)
        log.flush(final=True)
    lines = _lines(caplog)
    assert len(lines) == 2 and not any("off-" in line for line in lines), lines
    assert lines[1].startswith("2 more transfer(s) ended"), lines


def test_the_rate_is_a_setting_and_never_negative() -> None:
    env = {"KVBEAM_CONFIG": "d.yaml"}
    assert resolve("decode", environ=env).log_ends_per_s == 10.0
    assert resolve("decode", environ={**env, "KVBEAM_LOG_ENDS_PER_S": "0"}).log_ends_per_s == 0
    with pytest.raises(ConfigError, match="--log-ends-per-s: must be 0 or more"):
        resolve("decode", environ={**env, "KVBEAM_LOG_ENDS_PER_S": "-1"})
