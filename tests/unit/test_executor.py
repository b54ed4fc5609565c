"""The daemon's I/O executor logs a job's error instead of dropping it with its future."""

from __future__ import annotations

import logging
import threading

import pytest

from kvbeam.server.executor import LoggingExecutor


def _abort_decode(request_id: str) -> None:
    raise ValueError(f"Cannot invoke RPC on closed channel! ({request_id})")


def test_a_failed_fire_and_forget_job_is_logged_with_its_name_and_error(
        caplog: pytest.LogCaptureFixture) -> None:
    with LoggingExecutor(max_workers=1) as pool, caplog.at_level(logging.ERROR):
        pool.submit(_abort_decode, "qperr-1")  # nobody keeps the future
    failed = [r for r in caplog.records if r.name == "kvbeam.server.executor"]
    assert len(failed) == 1, caplog.text
    assert "_abort_decode" in failed[0].getMessage()
    assert "closed channel! (qperr-1)" in failed[0].getMessage()
    assert failed[0].exc_info is not None


def test_jobs_that_return_or_are_cancelled_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    with caplog.at_level(logging.ERROR):
        pool = LoggingExecutor(max_workers=1)
        first = pool.submit(gate.wait, 5)
        queued = pool.submit(lambda: 1)
        assert queued.cancel()
        gate.set()
        assert first.result(5) is True
        pool.shutdown(wait=True)
    assert not [r for r in caplog.records if r.name == "kvbeam.server.executor"]
