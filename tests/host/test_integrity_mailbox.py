"""The digest mailbox between real daemons over TCP (protocol 5, pools/mailbox.py).

Prefill writes each request's digest record into decode's mailbox slot as the final
chunk's last write; decode checks it when the completion arrives. A record that lies
about one field (test-only fault hook ``KVBEAM_FAULT_CORRUPT_RECORD`` on prefill, armed
with ``--enable-fault-injection``) fails the request with reason integrity, the detail
naming the field; decode never waits for a Digests message (there is none).
"""

from __future__ import annotations

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import RequestResult, drive
from kvbeam.server.faults import CORRUPT_LANDED_ENV, CORRUPT_RECORD_ENV, ENABLE_FLAG, SEED_ENV
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import pair
from tests.waiting import wait_until


def _all_verified(prefill: DaemonProcess, decode: DaemonProcess, d: KvbeamClient,
                  lengths: list[int], prefix: str) -> None:
    """Drive requests of ``lengths`` tokens; each must be Success, verified, on decode."""
    results = drive(prefill.address, decode.address, lengths, source_slots=8, concurrency=2,
                    prefix=prefix)
    assert all(r.ok for r in results), results
    for r in results:
        st = d.status(r.request_id)
        assert st.state is TransferState.SUCCESS and st.detail.startswith(
            "XXH3-128 verified"), st


def _all_failed_integrity(prefill: DaemonProcess, decode: DaemonProcess, d: KvbeamClient,
                          lengths: list[int], prefix: str) -> list[RequestResult]:
    """Drive requests of ``lengths`` tokens one at a time; each must fail ``integrity``
    on decode. Returns the results."""
    results = drive(prefill.address, decode.address, lengths, source_slots=8, concurrency=1,
                    prefix=prefix)
    assert all(r.state.startswith("Failed(integrity") for r in results), results
    for r in results:
        assert d.status(r.request_id).reason is FailureReason.INTEGRITY
    return results


def test_requests_are_verified_from_the_mailbox_and_no_digests_message_is_sent() -> None:
    with pair() as (prefill, decode, _p, d):
        _all_verified(prefill, decode, d, [1, 300, 4096, 20000], "box")
        assert "digest mailbox:" in decode.output and "record staging:" in prefill.output
        assert "Digests" not in decode.output


@pytest.mark.parametrize(("field", "detail"), [
    ("transfer_id", "digest record: transfer_id: "),
    ("request_id", "digest record: request_id: hash "),
    ("self_digest", "digest record: self_digest: "),
    ("digest", "XXH3-128 mismatch in 1 buffer(s)"),
    # decode's default sub-batches (16 MiB) cut these 700-token requests into none
    ("marks", "digest record: marks: 1 sub-batches notified before the record, decode "
              "cut this request into none"),
])
def test_a_lying_record_fails_integrity_naming_its_field(field: str, detail: str) -> None:
    env = {CORRUPT_RECORD_ENV: f"{field}:bad-"}
    with pair(prefill_extra=[ENABLE_FLAG], prefill_env=env) as (prefill, decode, p, d):
        results = _all_failed_integrity(prefill, decode, d, [700, 700], "bad-")
        for r in results:
            st = d.status(r.request_id)
            assert st.detail.startswith(detail), st
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


@pytest.mark.parametrize("paged", [False, True])
def test_large_requests_are_verified_in_sub_batches_as_they_land(paged: bool) -> None:
    """Protocol 6: decode advertises 64 KiB sub-batches; prefill notifies each as it is
    written, decode digests it at once, and Success comes after the last part's check."""
    sub = ["--verify-sub-batch-mib", "0.0625"]
    with pair(paged=paged, decode_extra=sub) as (prefill, decode, _p, d):
        _all_verified(prefill, decode, d, [1, 4096, 20000, 32768], "sub")
        # Each moves 0.4-10 MB (the per-slot states are most of a short one's): every
        # one went in sub-batches, as both sides' logs say.
        assert prefill.output.count("sub-batches marked before the last") == 4
        assert wait_until(lambda: decode.output.count("sub-batches digested as they landed")
                          == 4, 10), decode.output[-3000:]


def test_a_byte_flipped_in_any_sub_batch_fails_the_request() -> None:
    env = {CORRUPT_LANDED_ENV: "1", SEED_ENV: "5"}
    sub = ["--verify-sub-batch-mib", "0.0625", ENABLE_FLAG]
    with pair(decode_extra=sub, decode_env=env) as (prefill, decode, _p, d):
        for r in _all_failed_integrity(prefill, decode, d, [20000, 32768], "flip"):
            assert "XXH3-128 mismatch" in d.status(r.request_id).detail
        # Every sub-batch was hit once, so more than one buffer per request mismatches.
        assert decode.output.count("FAULT INJECTED: corrupted") > 2
