"""Decode's offers between real daemons over TCP: no BeginWrite once the pair is connected.

Decode pushes each reservation to its connected prefill (Offer); prefill's Send then
writes at once. The first request precedes any connection: its Send's handshake or
decode's ask to connect (decode-initiated pairing) comes first, so it asks BeginWrite
at most once; a chunked request asks once, for its first chunk (while its engine still
computes, the ask is what tells decode its bytes are landing). Counted by the daemons' metrics
(``kvbeam_begin_writes_total``, ``kvbeam_offers_total``).
"""

from __future__ import annotations

from kvbeam.scheduler import run_request
from kvbeam.states import TransferState
from tests.daemon_helpers import pair
from tests.metrics_helpers import delta, scrape, value

S = TransferState.SUCCESS
METRICS = ["--metrics", "127.0.0.1:0"]
N = 6


def test_reserve_before_send_needs_no_begin_write_after_the_first_handshake() -> None:
    with pair(decode_extra=METRICS, prefill_extra=METRICS) as (prefill, decode, p, d):
        assert prefill.metrics and decode.metrics
        first = run_request(p, d, "o-0", 700, 0)
        assert first.state.startswith("Success"), first
        p0, d0 = scrape(prefill.metrics), scrape(decode.metrics)
        # Before any connection: asked with BeginWrite, or offered once decode's ask to
        # connect won the race with the Send's handshake.
        asked = value(p0, "kvbeam_begin_writes_total")
        assert asked + value(p0, "kvbeam_offers_total", event="used") == 1, p0
        assert value(p0, "kvbeam_offers_total", event="missed") == asked

        for i in range(1, N + 1):
            result = run_request(p, d, f"o-{i}", 300 + 97 * i, i % 4, release=False)
            assert result.state.startswith("Success"), result
            # Decode verified the bytes against the digests that followed the writes.
            st = d.status(f"o-{i}")
            assert st.detail.startswith("XXH3-128 verified"), st
            d.release(f"o-{i}")
        p1, d1 = scrape(prefill.metrics), scrape(decode.metrics)
        assert delta(p1, p0, "kvbeam_begin_writes_total") == 0
        assert delta(p1, p0, "kvbeam_offers_total", event="used") == N
        assert delta(p1, p0, "kvbeam_offers_total", event="missed") == 0
        assert delta(d1, d0, "kvbeam_offers_total", event="made") == N


def test_a_chunked_request_asks_begin_write_for_its_first_chunk_and_succeeds() -> None:
    """Its final chunk, a moment after the first, writes under the first chunk's grant
    (prefill's ``GRANT_RENEW_S``: a second): one BeginWrite for the request."""
    with pair(decode_extra=METRICS, prefill_extra=METRICS) as (prefill, decode, p, d):
        assert prefill.metrics
        assert run_request(p, d, "f-0", 500, 0).state.startswith("Success")  # handshake
        p0 = scrape(prefill.metrics)
        d.reserve("f-1", 900, prefill.address)  # offered; the chunked Send does not use it
        p.send("f-1", 1, 900, decode.address, final=False, chunks=[(0, 512)])
        p.send("f-1", 1, 900, decode.address, final=True)
        st = d.wait("f-1", 20)
        assert st.state is S and st.detail.startswith("XXH3-128 verified"), st
        assert p.wait("f-1", 10).state is S
        d.release("f-1")
        p1 = scrape(prefill.metrics)
        assert delta(p1, p0, "kvbeam_begin_writes_total") == 1  # the first chunk's
        assert delta(p1, p0, "kvbeam_offers_total", event="received") == 1
        assert delta(p1, p0, "kvbeam_offers_total", event="used") == 0


def test_offers_kept_without_digests_are_answered_and_land_unverified() -> None:
    """Protocol 8: an Offer is kept without a word only when prefill's digests follow.
    With prefill's integrity off it answers each one (OFFER_ANSWER, kept, no digests), so
    decode checks the landing at once rather than waiting for a record that never comes:
    every offered request reaches Success, unverified, well within its deadline."""
    with pair(decode_extra=METRICS, prefill_extra=[*METRICS, "--integrity", "false"]) as (
            prefill, decode, p, d):
        assert prefill.metrics and decode.metrics
        assert run_request(p, d, "n-0", 700, 0).state.startswith("Success")  # handshake
        p0, d0 = scrape(prefill.metrics), scrape(decode.metrics)
        for i in range(1, N + 1):
            result = run_request(p, d, f"n-{i}", 300 + 97 * i, i % 4, release=False)
            # Not a wait for a record that never comes: that ends at the Transferring
            # deadline, Failed (timeout), never Success.
            assert result.state.startswith("Success"), result
            st = d.status(f"n-{i}")
            assert st.detail.startswith("bytes not verified: prefill sent no digests"), st
            d.release(f"n-{i}")
        p1, d1 = scrape(prefill.metrics), scrape(decode.metrics)
        assert delta(p1, p0, "kvbeam_offers_total", event="used") == N
        assert delta(p1, p0, "kvbeam_begin_writes_total") == 0
        assert delta(d1, d0, "kvbeam_offers_total", event="made") == N
        assert delta(d1, d0, "kvbeam_offers_total", event="refused") == 0
