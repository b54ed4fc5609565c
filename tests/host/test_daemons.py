"""Prefill and decode daemons as separate processes over TCP on loopback: the lifecycle rules.

The same scenarios run over RDMA in the soft-RoCE harness (tests/rdma/test_daemons_rdma.py).
"""

from __future__ import annotations

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.errors import BadRequest, Busy, DuplicateRequest, UnknownRequest
from kvbeam.scheduler import drive, run_request
from kvbeam.states import FailureReason, TransferState
from tests.control_helpers import run_cli
from tests.daemon_helpers import free_slots, pair, start
from tests.fixtures import shipped_config
from tests.waiting import wait_until

S, F = TransferState.SUCCESS, TransferState.FAILED


@pytest.mark.parametrize("paged", [False, True], ids=["unified", "paged"])
def test_concurrent_requests_all_succeed_and_slots_return(paged: bool) -> None:
    with pair(paged=paged) as (prefill, decode, _p, _d):
        lens = [1 + (i * 2654435761) % 20000 for i in range(20)]
        results = drive(prefill.address, decode.address, lens, source_slots=8, concurrency=6)
        bad = [r for r in results if not r.ok]
        assert not bad, bad
        assert all(r.bytes > 0 for r in results)
        assert "XXH3-128 mismatch" not in decode.output


def test_reserve_when_full_is_resource_exhausted() -> None:
    with pair() as (prefill, decode, _p, d):
        for i in range(16):  # decode.yaml has 16 slots
            d.reserve(f"hold-{i}", 100, prefill.address)
        try:
            d.reserve("one-too-many", 100, prefill.address)
        except Busy as exc:
            assert "no free request slot" in str(exc), exc
        else:  # a slot was free: say which reservation ended, and why
            held = [d.status(f"hold-{i}") for i in range(16)]
            raise AssertionError(f"a 17th reservation fit; ended: "
                                 f"{[h for h in held if h.state.terminal]}\n"
                                 f"{decode.output[-4000:]}\n{prefill.output[-3000:]}")
        d.abort("hold-0")
        # A scheduler's abort frees the slot once prefill has confirmed it stopped
        # writing (a round trip to prefill), not when Abort returns.
        assert wait_until(lambda: free_slots(d) == 1, 10)
        d.reserve("now-fits", 100, prefill.address)
        assert free_slots(d) == 0


def test_duplicate_and_bad_requests_are_refused_and_daemons_stay_up() -> None:
    with pair() as (prefill, decode, p, d):
        r = run_request(p, d, "dup", 500, 0)
        assert r.ok
        with pytest.raises(DuplicateRequest):
            d.reserve("dup", 500, prefill.address)
        with pytest.raises(DuplicateRequest):
            p.send("dup", 0, 500, decode.address)
        with pytest.raises(BadRequest, match=r"seq_len must be in 1\.\.32768"):
            d.reserve("neg", -5, prefill.address)
        with pytest.raises(BadRequest, match="seq_len must be in"):
            p.send("huge", 0, 10**9, decode.address)
        with pytest.raises(BadRequest, match="request slot 99 out of range"):
            p.send("slot", 99, 10, decode.address)
        with pytest.raises(BadRequest, match="request_id must be"):
            d.reserve("", 10, prefill.address)
        with pytest.raises(BadRequest, match="chunk"):
            p.send("chunky", 0, 100, decode.address, final=False, chunks=[(50, 10)])
        with pytest.raises(UnknownRequest):
            d.status("never-seen")
        with pytest.raises(BadRequest, match="not Success"):
            d.reserve("live", 10, prefill.address)
            d.release("live")
        # both still serve
        assert run_request(p, d, "after", 300, 1).ok


def test_send_without_reservation_waits_for_one_then_fails_naming_it() -> None:
    # A Send may come before decode's reservation (docs/protocol.md, "Either order"):
    # it waits --send-wait-s for it, then fails with a timeout that says so.
    with pair(prefill_extra=["--send-wait-s", "1"]) as (prefill, decode, p, d):
        p.send("orphan", 0, 100, decode.address)
        st = p.wait("orphan", 10)
        assert st.state is F and st.reason is FailureReason.TIMEOUT, str(st)
        assert "WaitingForInput for 1.0 s (decode's reservation" in st.detail, st.detail
        # Decode reserves it after all (a loaded decode): prefill refuses the Offer and
        # aborts the reservation at once, not at decode's Bootstrapping deadline. Only
        # prefill's word gives this reason and text: the deadline would fail it TIMEOUT,
        # "no progress in Bootstrapping for 4.0 s".
        d.reserve("orphan", 100, prefill.address)
        st = d.wait("orphan", 20)
        assert st.state is F and st.reason is FailureReason.PEER_FAILED, str(st)
        assert "prefill failed before decode reserved: timeout" in st.detail, st.detail


def test_abort_on_decode_propagates_to_prefill_and_frees_the_slot() -> None:
    with pair() as (prefill, _decode, _p, d):
        d.reserve("ab", 2000, prefill.address)
        st = d.abort("ab", "scheduler changed its mind")
        assert st.state is F and st.reason is FailureReason.ABORTED
        # the slot returns: all 16 can be reserved again
        for i in range(16):
            d.reserve(f"x{i}", 10, prefill.address)


def test_abort_on_prefill_mid_request_reaches_decode() -> None:
    with pair() as (prefill, decode, p, d):
        d.reserve("pab", 600, prefill.address)
        # a non-final chunk (its first KV page): prefill handshakes, begins, writes it,
        # then waits for more
        p.send("pab", 0, 600, decode.address, final=False, chunks=[(0, 256)])
        assert wait_until(lambda: d.status("pab").state is TransferState.TRANSFERRING, 10)
        p.abort("pab", "engine cancelled")
        st = d.wait("pab", 10)
        assert st.state is F and st.reason is FailureReason.PEER_FAILED
        assert "engine cancelled" in st.detail
        assert p.status("pab").reason is FailureReason.ABORTED


def test_chunked_send_moves_everything_once_final() -> None:
    with pair() as (prefill, decode, p, d):
        d.reserve("chunked", 3000, prefill.address)
        p.send("chunked", 2, 3000, decode.address, final=False, chunks=[(0, 1024)])
        p.send("chunked", 2, 3000, decode.address, final=False, chunks=[(1024, 2048)])
        assert d.status("chunked").state is not S
        with pytest.raises(BadRequest, match=r"must keep the index lists \(or source slot\)"):
            p.send("chunked", 3, 3000, decode.address, final=False, chunks=[(2048, 2560)])
        p.send("chunked", 2, 3000, decode.address, final=True)
        st = d.wait("chunked", 20)
        assert st.state is S, st
        with pytest.raises(DuplicateRequest):
            p.send("chunked", 2, 3000, decode.address, final=True)


def test_reservation_lease_expires_and_frees_the_slot() -> None:
    with pair() as (prefill, _decode, _p, d):
        d.reserve("lease", 100, prefill.address)
        st = d.wait("lease", 15)
        assert st.state is F and st.reason is FailureReason.TIMEOUT, str(st)
        # The deadline that ended it is the configured one (4 s in these tests), not
        # another, longer one.
        assert st.detail == "no progress in Bootstrapping for 4.0 s", st.detail
        for i in range(16):
            d.reserve(f"y{i}", 10, prefill.address)


def test_incompatible_pair_fails_on_both_sides_with_the_field_named() -> None:
    decode = start("decode", paged=True)
    try:
        prefill = start("prefill")  # unified
        try:
            with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
                d.reserve("mismatch", 100, prefill.address)
                p.send("mismatch", 0, 100, decode.address)
                st = p.wait("mismatch", 10)
                # Incompatible whichever came first: prefill's own handshake for the
                # Send, or decode's Connect for its reservation (refused: the Send then
                # fails with that refusal).
                assert st.state is F and st.reason is FailureReason.INCOMPATIBLE, st
                assert "unified-KV mode: prefill=True, decode=False" in st.detail
                dst = d.wait("mismatch", 10)
                assert dst.state is F and "unified-KV mode" in dst.detail
            assert "differ in unified-KV mode" in decode.output
        finally:
            prefill.stop()
    finally:
        decode.stop()


def test_prefill_killed_mid_request_fails_decode_within_the_deadline() -> None:
    decode = start("decode")
    try:
        prefill = start("prefill")
        with KvbeamClient(decode.address) as d, KvbeamClient(prefill.address) as p:
            d.reserve("victim", 4000, prefill.address)
            p.send("victim", 0, 4000, decode.address, final=False, chunks=[(0, 256)])
            assert wait_until(lambda: d.status("victim").state is TransferState.TRANSFERRING, 10)
            prefill.kill()
            st = d.wait("victim", 20)
            # Noticed at once, by the loss of prefill's connections, not at the
            # Transferring deadline (6 s here: TIMEOUT, "no progress in Transferring").
            assert st.state is F and st.reason is FailureReason.PEER_FAILED, str(st)
            for i in range(16):  # every slot is free again
                d.reserve(f"z{i}", 10, prefill.address)
    finally:
        decode.stop()


def test_decode_restart_is_detected_and_a_new_handshake_serves() -> None:
    decode = start("decode")
    prefill = start("prefill")
    try:
        with KvbeamClient(prefill.address) as p:
            with KvbeamClient(decode.address) as d:
                assert run_request(p, d, "before", 1000, 0).ok
                d.reserve("inflight", 4000, prefill.address)
                p.send("inflight", 1, 4000, decode.address, final=False, chunks=[(0, 256)])
                assert wait_until(
                    lambda: d.status("inflight").state is TransferState.TRANSFERRING, 10)
            address = decode.address
            decode.kill()
            st = p.wait("inflight", 20)
            # Both of prefill's sockets to decode end. The peer channel's end first: the
            # peer is lost (peer_failed). The data link's first: the request is resent,
            # and the resend's handshake finds nobody (peer_unreachable, the link's
            # failure named); both on the daemon's one loop, in the kernel's order.
            assert st.state is F and st.reason in (FailureReason.PEER_FAILED,
                                                   FailureReason.TRANSPORT_ERROR,
                                                   FailureReason.PEER_UNREACHABLE), st
            if st.reason is FailureReason.PEER_UNREACHABLE:
                assert "the link failed first" in st.detail, st
            decode = start("decode", listen=address)
            with KvbeamClient(decode.address) as d:
                assert run_request(p, d, "after-restart", 1000, 0).ok
    finally:
        prefill.stop()
        decode.stop()


def test_sigterm_shuts_down_cleanly() -> None:
    decode = start("decode")
    with KvbeamClient(decode.address) as d:
        d.reserve("pending", 10, "127.0.0.1:1")
    assert decode.stop() == 0
    out = decode.output
    assert "decode daemon stopped: nothing registered, transport closed" in out


def test_local_check_refuses_to_start(tmp_path: object) -> None:
    import pathlib

    assert isinstance(tmp_path, pathlib.Path)
    bad = tmp_path / "bad.yaml"
    text = pathlib.Path(shipped_config("prefill")).read_text()
    head, _, draft = text.partition("draft:")
    bad.write_text(head + "draft:" + draft.replace("unified_kv: true", "unified_kv: false"))
    from kvbeam.errors import DaemonStartError

    with pytest.raises(DaemonStartError) as info:
        start("prefill", cfg=str(bad))
    assert "DSV4 target and draft pools must use the same unified-KV mode" in info.value.output


def test_scheduler_cli_verbs() -> None:
    import json

    kv = run_cli

    with pair() as (prefill, decode, _p, _d):
        r = kv("reserve", "--address", decode.address, "--request-id", "cli-1", "--seq-len",
               "700", "--prefill", prefill.address, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["slot"] >= 0
        r = kv("send", "--address", prefill.address, "--request-id", "cli-1", "--source-slot",
               "3", "--seq-len", "700", "--decode", decode.address, "--wait", "20")
        assert r.returncode == 0 and "Success" in r.stdout, r.stdout + r.stderr
        r = kv("status", "--address", decode.address, "--request-id", "cli-1", "--json")
        assert json.loads(r.stdout)["state"] == "Success"
        assert kv("release", "--address", decode.address, "--request-id", "cli-1").returncode == 0
        r = kv("status", "--address", decode.address, "--request-id", "nope")
        assert r.returncode == 2 and "unknown request id" in r.stderr
        r = kv("reserve", "--address", decode.address, "--request-id", "cli-2", "--seq-len",
               "10", "--prefill", prefill.address)
        r = kv("abort", "--address", decode.address, "--request-id", "cli-2")
        assert r.returncode == 0 and "Failed(aborted" in r.stdout
        r = kv("drive", "--prefill", prefill.address, "--decode", decode.address,
               "--requests", "3", "--prefix", "cli-drive")
        assert r.returncode == 0 and "3/3 Success" in r.stdout, r.stdout + r.stderr


def test_one_prefill_two_decodes_and_two_prefills_one_decode() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvbeam.procs import PendingDaemon, spawn_daemon
    from tests.daemon_helpers import FAST

    def spawn(role: str, seed: str) -> PendingDaemon:
        return spawn_daemon(role, shipped_config(role), extra=["--transport", "tcp", "--fill-seed",
                                                       seed, *FAST])

    pending = [spawn("prefill", "1"), spawn("prefill", "3"), spawn("decode", "2"),
               spawn("decode", "4")]
    daemons = []
    try:
        for p in pending:
            daemons.append(p.ready(120))
        p1, p2, d1, d2 = daemons
        pairs = [(p1, d1), (p1, d2), (p2, d1), (p2, d2)]

        def run_pair(i: int) -> list[bool]:
            pf, dc = pairs[i]
            results = drive(pf.address, dc.address, [500 + 700 * k for k in range(6)],
                            source_slots=8, concurrency=3, prefix=f"mesh{i}")
            return [r.ok for r in results]

        with ThreadPoolExecutor(4) as pool:
            oks = [ok for batch in pool.map(run_pair, range(4)) for ok in batch]
        assert len(oks) == 24 and all(oks)
    finally:
        for d in daemons:
            d.stop()
        for p in pending[len(daemons):]:
            p.proc.kill()
