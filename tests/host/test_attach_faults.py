"""Engine attach faults (real processes, TCP): an engine SIGKILLed mid-transfer, a stranger's
attach, bad descriptions. What each produced, and what the daemon holds afterwards
(fds, memfd mappings, RSS, registered regions), measured."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from kvbeam.server.faults import ENABLE_FLAG, WRITE_DELAY_ENV
from kvbeam.states import FailureReason, TransferState
from tests.attach_helpers import Engine, fd_targets, proc_counts, start_engine_daemon, write_config
from tests.fixtures import UNIFIED_DRAFT, side
from tests.metrics_helpers import scrape, value
from tests.waiting import wait_until

SEQ = 700


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    tmp_path.chmod(0o700)
    return tmp_path


def _daemon_holds(pid: int, metrics: str) -> dict[str, int]:
    counts = proc_counts(pid)
    counts["regions"] = int(value(scrape(metrics), "kvbeam_engine_registered_regions"))
    return counts


@dataclasses.dataclass
class SlowPair:
    """Two engine-mode daemons (prefill's writes delayed 3 s), an attached engine each."""

    prefill: DaemonProcess
    decode: DaemonProcess
    engines: list[Engine]
    p: KvbeamClient
    d: KvbeamClient
    fds_before: list[str]  # daemon ``holds_of``'s open fds before the engines attached


@contextlib.contextmanager
def slow_engine_pair(workdir: Path, holds_of: str) -> Iterator[tuple[SlowPair, dict[str, int]]]:
    """Start the pair; yield it with what daemon ``holds_of`` held before the engines attached."""
    cfg = write_config(workdir / "side.yaml", side())
    psock, dsock = str(workdir / "p.sock"), str(workdir / "d.sock")
    decode = start_engine_daemon("decode", dsock)
    prefill = start_engine_daemon("prefill", psock, extra=[ENABLE_FLAG],
                                  env={WRITE_DELAY_ENV: "3"})
    engines: list[Engine] = []
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            daemon = prefill if holds_of == "prefill" else decode
            before = _daemon_holds(daemon.proc.pid, daemon.metrics)
            fds_before = fd_targets(daemon.proc.pid)
            engines += [Engine(psock, cfg, seed=1), Engine(dsock, cfg, seed=2)]
            assert all(e.attached for e in engines), [e.first for e in engines]
            yield SlowPair(prefill, decode, engines, p, d, fds_before), before
    finally:
        for e in engines:
            e.stop()
        prefill.stop()
        decode.stop()


def test_engine_sigkill_mid_transfer_fails_both_sides_and_leaks_nothing(workdir: Path) -> None:
    # ~100 MB of pools, so that what the daemon maps shows in its RSS.
    draft = dataclasses.replace(UNIFIED_DRAFT, num_req_slots=16, max_context_len=16384)
    cfg = write_config(workdir / "side.yaml", side(
        draft=draft, head_dim=256, num_req_slots=16, max_context_len=16384))
    psock, dsock = str(workdir / "p.sock"), str(workdir / "d.sock")
    decode = start_engine_daemon("decode", dsock)
    # A slow wire: prefill waits 3 s after BeginWrite, so the request is mid-transfer.
    prefill = start_engine_daemon("prefill", psock, extra=[ENABLE_FLAG],
                                  env={WRITE_DELAY_ENV: "3"})
    engines: list[Engine] = []
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            assert not d.healthy(2.0)
            before = _daemon_holds(decode.proc.pid, decode.metrics)
            engines += [Engine(psock, cfg, seed=1), Engine(dsock, cfg, seed=2)]
            pe, de = engines
            assert pe.attached and de.attached, (pe.first, de.first)
            attached = _daemon_holds(decode.proc.pid, decode.metrics)
            d.reserve("k1", SEQ, prefill.address)
            p.send("k1", 0, SEQ, decode.address)
            # Mid-transfer: prefill holds decode's grant and waits out the slow wire.
            # Decode is Transferring after a BeginWrite, but still Bootstrapping when
            # prefill took its Offer (no BeginWrite: decode learns of the writes when they
            # land), which path depends on which came first; prefill is Transferring in both.
            assert wait_until(lambda: p.status("k1").state is TransferState.TRANSFERRING,
                              30), (d.status("k1"), p.status("k1"), prefill.output[-3000:],
                                    decode.output[-3000:])
            assert d.status("k1").state in (TransferState.BOOTSTRAPPING,
                                            TransferState.TRANSFERRING), d.status("k1")
            de.kill()
            for c in (p, d):  # bounded: well inside the 6 s transfer deadline
                st = c.wait("k1", 15)
                assert st.state is TransferState.FAILED, str(st)
            assert "engine memory detached" in d.status("k1").detail
            assert p.status("k1").reason in (FailureReason.PEER_FAILED,
                                             FailureReason.SHUTDOWN)
            assert wait_until(lambda: value(scrape(decode.metrics), "kvbeam_engine_attached") == 0,
                            15)
            assert not d.healthy(2.0)
            wait_until(lambda: proc_counts(decode.proc.pid)["fds"] <= before["fds"], 5)
            after = _daemon_holds(decode.proc.pid, decode.metrics)
            print(f"\ndecode daemon holds: before attach {before}, attached {attached}, "
                  f"after engine SIGKILL {after}")
            assert attached["memfd_maps"] > 0 and attached["regions"] > 0
            assert after["memfd_maps"] == 0 and after["regions"] == 0
            assert after["fds"] == before["fds"], (before, after)
            # The daemon maps ~100 MB of the engine's pages (TCP faults in only what it
            # touches; an RDMA registration pins all): none may stay resident.
            assert after["rss_kib"] - before["rss_kib"] < 16 << 10, (before, after)
            # A new engine attaches to the same daemon and the pair serves again.
            engines.append(Engine(dsock, cfg, seed=4))
            assert engines[-1].attached and d.wait_healthy(10)
            assert wait_until(lambda: value(scrape(prefill.metrics), "kvbeam_peers") == 0, 15)
            res = d.reserve("k2", SEQ, prefill.address)
            p.send("k2", 0, SEQ, decode.address)
            assert d.wait("k2", 60).state is TransferState.SUCCESS
            assert engines[-1].digests(res.slot, SEQ) == pe.digests(0, SEQ)
    finally:
        for e in engines:
            e.stop()
        prefill.stop()
        decode.stop()


def test_prefill_engine_sigkill_mid_transfer_fails_both_sides(workdir: Path) -> None:
    with slow_engine_pair(workdir, "prefill") as (pair, before):
        prefill, p, d = pair.prefill, pair.p, pair.d
        d.reserve("q1", SEQ, prefill.address)
        p.send("q1", 0, SEQ, pair.decode.address)
        assert wait_until(lambda: p.status("q1").state is TransferState.TRANSFERRING, 30)
        pair.engines[0].kill()
        for c in (p, d):
            st = c.wait("q1", 15)
            assert st.state is TransferState.FAILED, str(st)
        assert "engine memory detached" in p.status("q1").detail
        assert wait_until(
            lambda: value(scrape(prefill.metrics), "kvbeam_engine_attached") == 0, 15)
        wait_until(lambda: proc_counts(prefill.proc.pid)["fds"] <= before["fds"], 5)
        after = _daemon_holds(prefill.proc.pid, prefill.metrics)
        print(f"\nprefill daemon holds: before attach {before}, after engine SIGKILL {after}")
        assert after["memfd_maps"] == 0 and after["regions"] == 0
        assert d.healthy(2.0)  # decode's engine is still attached


def test_decode_engine_detach_during_requests_fails_them_and_releases_memory(
        workdir: Path) -> None:
    """A clean detach (not a crash) while one request is Transferring and one only reserved."""
    with slow_engine_pair(workdir, "decode") as (pair, before):
        prefill, decode, p, d = pair.prefill, pair.decode, pair.p, pair.d
        pe, de = pair.engines
        fds_before = pair.fds_before
        d.reserve("w1", SEQ, prefill.address)  # reserved, never sent
        d.reserve("t1", SEQ, prefill.address)
        p.send("t1", 0, SEQ, decode.address)
        # Mid-transfer, as in the SIGKILL test above: prefill is Transferring (it holds
        # decode's grant and waits out the slow wire) whichever came first, decode's Offer
        # (decode still Bootstrapping: it learns of the writes when they land) or the Send
        # (a BeginWrite: decode Transferring).
        assert wait_until(lambda: p.status("t1").state is TransferState.TRANSFERRING,
                          30), (d.status("t1"), p.status("t1"), prefill.output[-3000:],
                                decode.output[-3000:])
        assert d.status("t1").state in (TransferState.BOOTSTRAPPING,
                                        TransferState.TRANSFERRING), d.status("t1")
        assert de.cmd("detach", timeout=30) == "detached"  # returns once memory released
        for c in (p, d):  # bounded: well inside the 6 s transfer deadline
            st = c.wait("t1", 15)
            assert st.state is TransferState.FAILED, str(st)
        w1 = d.wait("w1", 15)
        assert w1.state is TransferState.FAILED and "engine memory detached" in w1.detail
        assert "engine memory detached" in d.status("t1").detail
        assert p.status("t1").reason in (FailureReason.PEER_FAILED, FailureReason.SHUTDOWN)
        assert not d.healthy(2.0)
        wait_until(lambda: proc_counts(decode.proc.pid)["fds"] <= before["fds"] + 1, 5)
        after = _daemon_holds(decode.proc.pid, decode.metrics)
        def new_fds() -> list[str]:
            return sorted((Counter(fd_targets(decode.proc.pid)) - Counter(fds_before)).elements())

        # A scrape's socket closes on the daemon's loop a moment after the scraper read its
        # answer (_daemon_holds scrapes): wait for that, not for anything else.
        wait_until(lambda: len(new_fds()) <= 1, 5)
        new = new_fds()
        print(f"\ndecode daemon holds: before attach {before}, after detach mid-request "
              f"{after}; new fds {new}")
        assert after["memfd_maps"] == 0 and after["regions"] == 0
        # At most the control channel decode opened to prefill to abort t1 there.
        assert len(new) <= 1 and all(t.startswith("socket:") for t in new), new
        # The detached engine attaches again; the pair serves.
        assert de.cmd("attach").startswith("attached ") and d.wait_healthy(10)
        assert wait_until(lambda: value(scrape(prefill.metrics), "kvbeam_peers") == 0, 15)
        res = d.reserve("t2", SEQ, prefill.address)
        p.send("t2", 0, SEQ, decode.address)
        assert d.wait("t2", 60).state is TransferState.SUCCESS
        assert de.digests(res.slot, SEQ) == pe.digests(0, SEQ)



@pytest.fixture
def nobody_dir() -> Iterator[str]:
    """A private directory owned by ``nobody`` (the daemon's socket lives there)."""
    path = tempfile.mkdtemp(prefix="kvbeam-nobody-")
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the daemon as nobody")
def test_a_strangers_attach_is_refused_naming_its_uid(nobody_dir: str, workdir: Path) -> None:
    # Root bypasses the socket's 0600 mode: the peer-credential check must refuse it.
    cfg = write_config(workdir / "side.yaml", side())
    os.chmod(workdir, 0o755)
    os.chmod(cfg, 0o644)
    sock = os.path.join(nobody_dir, "d.sock")
    decode = start_engine_daemon("decode", sock, user="nobody")
    assert os.stat(sock).st_uid == pwd.getpwnam("nobody").pw_uid
    try:
        e = Engine(sock, cfg, seed=1)
        e.stop()
        assert e.first.startswith("refused peer_uid:"), e.first
        assert "peer uid 0" in e.first and "--attach-allow-uid" in e.first
        assert wait_until(lambda: "attach refused: peer uid 0" in decode.output, 5)
        with KvbeamClient(decode.address) as d:
            assert not d.healthy(2.0)
    finally:
        decode.stop()


def test_bad_descriptions_are_refused_naming_the_field_and_leak_nothing(workdir: Path) -> None:
    good = write_config(workdir / "side.yaml", side())
    other = write_config(workdir / "other.yaml", side(head_dim=32))
    bad_draft = write_config(workdir / "bad.yaml", side(
        draft=dataclasses.replace(UNIFIED_DRAFT, unified_kv=False)))
    strict = start_engine_daemon("decode", str(workdir / "s.sock"), config=good)
    loose = start_engine_daemon("prefill", str(workdir / "l.sock"))
    try:
        before = proc_counts(strict.proc.pid)
        refused_engines = {
            "config": Engine(str(workdir / "s.sock"), other, seed=1),
            "dmabuf": Engine(str(workdir / "s.sock"), good, seed=1, memory_kind="dmabuf"),
            "draft": Engine(str(workdir / "l.sock"), bad_draft, seed=1),
        }
        refused = {kind: e.first for kind, e in refused_engines.items()}
        for e in refused_engines.values():  # each refused engine process ends here
            e.stop()
        assert refused["config"].startswith("refused config:"), refused
        assert "target.head_dim: daemon=16, engine=32" in refused["config"]
        assert refused["dmabuf"].startswith("refused memory_kind:")
        assert "integrity check is on, and it cannot read device memory" in refused["dmabuf"]
        assert refused["draft"].startswith("refused config.draft:")
        assert "DSV4 target and draft pools must use the same unified-KV mode" in refused["draft"]
        assert "(prefill side)" in refused["draft"]
        # One engine at a time: a second attach is refused naming the first one's pid.
        first = Engine(str(workdir / "s.sock"), good, seed=1)
        second = Engine(str(workdir / "s.sock"), good, seed=2)
        assert first.attached
        assert second.first.startswith("refused op:"), (second.first, strict.output[-3000:])
        assert f"another engine (pid {first.proc.pid}, uid 0) is attached" in second.first
        for e in (first, second):
            e.stop()
        assert wait_until(lambda: value(scrape(strict.metrics), "kvbeam_engine_attached") == 0,
                        10)
        # The engine's socket closes just after the release the gauge reports.
        wait_until(lambda: proc_counts(strict.proc.pid)["fds"] <= before["fds"], 5)
        after = proc_counts(strict.proc.pid)
        print(f"\nstrict daemon after 4 refusals and one attach/detach: {before} -> {after}")
        assert after["fds"] == before["fds"] and after["memfd_maps"] == 0
    finally:
        strict.stop()
        loose.stop()
