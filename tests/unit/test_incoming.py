"""Decode's request record as a state machine: its landing's phase, event by event.

No threads, no core: each test feeds what the core does (a notification, the check's
start and verdict, a resend on a new link) and asserts the phase.
"""

from __future__ import annotations

import pytest

from kvbeam.server.core.incoming import Incoming, Landing


def _res() -> Incoming:
    return Incoming("r", 2, 128, "prefill:1", 32, {}, 4096)


def _at(res: Incoming) -> Landing:
    """The phase (a call, so the type checker does not narrow it across the moves)."""
    return res.landing


def test_a_landing_is_notified_checked_once_and_verified() -> None:
    res = _res()
    assert _at(res) is Landing.AWAITED and not res.landed and not res.checking
    res.notified(now=5.0)
    assert _at(res) is Landing.LANDED and res.landed and res.landed_at == 5.0
    res.notified(now=6.0)  # a repeated notification
    assert _at(res) is Landing.LANDED and res.landed_at == 5.0
    res.verify()
    assert _at(res) is Landing.VERIFYING and res.checking
    with pytest.raises(RuntimeError, match="from verifying to verifying"):
        res.verify()  # a second check of the same landing
    res.notified(now=7.0)  # a late duplicate does not move a landing under its check
    assert _at(res) is Landing.VERIFYING
    res.verified(now=8.0)
    assert _at(res) is Landing.VERIFIED and res.success_at == 8.0 and res.checking


def test_no_check_before_the_notification_and_no_success_without_a_check() -> None:
    res = _res()
    with pytest.raises(RuntimeError, match="from awaited to verifying"):
        res.verify()
    with pytest.raises(RuntimeError, match="from awaited to verified"):
        res.verified(now=1.0)
    assert res.success_at is None


def test_a_resend_before_the_check_starts_over_and_drops_the_old_marks() -> None:
    res = _res()
    res.marked = {1: None}  # type: ignore[dict-item]  # a mark of the old landing
    res.notified(now=1.0)
    res.relinked()
    assert _at(res) is Landing.AWAITED and res.marked == {}


def test_a_landing_under_its_check_cannot_be_replaced() -> None:
    res = _res()
    res.notified(now=1.0)
    res.verify()
    with pytest.raises(RuntimeError, match="being checked"):
        res.relinked()
    assert _at(res) is Landing.VERIFYING
