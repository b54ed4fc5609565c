"""The digest mailbox between real daemons over TCP (protocol 5, pools/mailbox.py).

Prefill writes each request's digest record into decode's mailbox slot as the final
chunk's last write; decode checks it when the completion arrives. A record that lies
about one field (test-only fault hook ``KVBEAM_FAULT_CORRUPT_RECORD`` on prefill, armed
with ``--enable-fault-injection``) fails the request with reason integrity, the detail
naming the field; decode never waits for a Digests message (there is none).
"""

from __future__ import annotations

import pytest

from kvbeam.procs import wait_until
from kvbeam.scheduler import drive
from kvbeam.server.faults import CORRUPT_RECORD_ENV, ENABLE_FLAG
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import pair


def test_requests_are_verified_from_the_mailbox_and_no_digests_message_is_sent() -> None:
    with pair() as (prefill, decode, _p, d):
        results = drive(prefill.address, decode.address, [1, 300, 4096, 20000],
                        source_slots=8, concurrency=2, prefix="box")
        assert all(r.ok for r in results), results
        for r in results:
            st = d.status(r.request_id)
            assert st.state is TransferState.SUCCESS and st.detail.startswith(
                "XXH3-128 verified"), st
        assert "digest mailbox:" in decode.output and "record staging:" in prefill.output
        assert "Digests" not in decode.output


@pytest.mark.parametrize(("field", "detail"), [
    ("transfer_id", "digest record: transfer_id: "),
    ("request_id", "digest record: request_id: hash "),
    ("self_digest", "digest record: self_digest: "),
    ("digest", "XXH3-128 mismatch in 1 buffer(s)"),
])
def test_a_lying_record_fails_integrity_naming_its_field(field: str, detail: str) -> None:
    env = {CORRUPT_RECORD_ENV: f"{field}:bad-"}
    with pair(prefill_extra=[ENABLE_FLAG], prefill_env=env) as (prefill, decode, p, d):
        results = drive(prefill.address, decode.address, [700, 700], source_slots=8,
                        concurrency=1, prefix="bad-")
        assert [r.state.startswith("Failed(integrity") for r in results] == [True, True], \
            results
        for r in results:
            st = d.status(r.request_id)
            assert st.reason is FailureReason.INTEGRITY and st.detail.startswith(detail), st
            # Prefill hears decode's verdict (its Abort): the request ends failed there or
            # its log says decode reported the failure after prefill's own Success.
            assert wait_until(lambda rid=r.request_id: p.status(rid).state is
                              TransferState.FAILED or f"request {rid}: decode reports a "
                              "failure after this side ended" in prefill.output, 10)
        assert prefill.output.count("FAULT INJECTED: digest record") == 2
        # Requests the hook does not aim at still verify, and every slot came back.
        ok = drive(prefill.address, decode.address, [700], source_slots=8, prefix="good-")
        assert ok[0].ok, ok
        for i in range(16):
            d.reserve(f"after-{i}", 10, prefill.address)


def test_integrity_off_on_prefill_lands_unverified_on_decode() -> None:
    with pair(prefill_extra=["--integrity", "false"]) as (prefill, decode, _p, d):
        results = drive(prefill.address, decode.address, [300], source_slots=8, prefix="off")
        assert results[0].ok
        st = d.status(results[0].request_id)
        assert st.state is TransferState.SUCCESS and st.detail.startswith(
            "bytes not verified: prefill sent no digests"), st
