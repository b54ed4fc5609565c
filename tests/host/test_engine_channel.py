"""Engines drive their requests over the attach socket (the engine channel), no gRPC.

Two ``--pools engine`` daemons over TCP; two engine processes (tests/channel_engine.py)
attach and drive every request with ``kvbeam.engine.Sender``/``Receiver`` on their
attachment: the frames go to their own daemon, the states come back pushed. Decode's
daemon offers the reservation to prefill's over the existing peer link; nobody calls
the scheduler API. Each engine checks it never imported gRPC.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.pools.indices import expected_lengths
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.procs import DaemonProcess
from kvbeam.server.faults import CORRUPT_LANDED_ENV, ENABLE_FLAG, SEED_ENV
from kvbeam.states import TransferState
from tests.attach_helpers import start_engine_pair, write_config
from tests.control_helpers import run_cli
from tests.daemon_helpers import FAST
from tests.engine_lists import kind_items
from tests.fixtures import side
from tests.metrics_helpers import scrape, value
from tests.waiting import wait_until

SEQ = 700
ROOT = str(Path(__file__).resolve().parents[2])


class ChannelEngine:
    """A tests/channel_engine.py process attached to one daemon."""

    def __init__(self, socket_path: str, config: str, seed: int, pushes: str = "all",
                 reattach: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.channel_engine", "--socket", socket_path,
             "--config", config, "--seed", str(seed), "--pushes", pushes,
             *(["--reattach"] if reattach else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT)
        self.first = self._line(120)
        assert self.first.startswith("attached "), self.first

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        out = self.proc.stdout
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(out.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            err = self.proc.stderr.read() if self.proc.poll() is not None and \
                self.proc.stderr else ""
            raise RuntimeError(f"engine gave no answer (exit {self.proc.poll()}): {err}")
        return box[0].strip()

    def cmd(self, text: str, timeout: float = 60) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("exit", 5)
                self.proc.wait(10)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess, ChannelEngine,
                                              ChannelEngine]]:
    """(prefill daemon, decode daemon, prefill engine, decode engine), all attached."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    with attached_pair(tmp_path, cfg, [*FAST, "--send-wait-s", "3"]) as four:
        yield four


@contextlib.contextmanager
def attached_pair(tmp: Path, cfg: str, deadlines: list[str], pushes: str = "all",
                  transport: str = "tcp", env: dict[str, str] | None = None
                  ) -> Iterator[tuple[DaemonProcess, DaemonProcess, ChannelEngine,
                                      ChannelEngine]]:
    """Two ``--pools engine`` daemons (over ``transport``, with ``env``) and a
    ChannelEngine attached to each (prefill's pools filled with seed 1, decode's with 2;
    both with ``pushes``); all stopped on exit."""
    psock, dsock = str(tmp / "p.sock"), str(tmp / "d.sock")
    p, d = start_engine_pair(psock, dsock, deadlines=deadlines, transport=transport,
                             env=env)
    pe = de = None
    try:
        pe = ChannelEngine(psock, cfg, 1, pushes)
        de = ChannelEngine(dsock, cfg, 2, pushes)
        yield p, d, pe, de
    finally:
        for e in (pe, de):
            if e is not None:
                e.stop()
        p.stop()
        d.stop()


def _no_grpc(*engines: ChannelEngine) -> None:
    for e in engines:
        assert e.cmd("grpc") == "grpc False"


def test_reserve_first_moves_the_bytes_and_pushes_every_state(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    prefill, decode, pe, de = engines
    for i in range(3):  # the first handshakes; later ones use decode's offer
        rid = f"r{i}"
        assert de.cmd(f"reserve {rid} {SEQ} {prefill.address} {10 + i}") == f"reserve {rid}"
        assert pe.cmd(f"send {rid} {SEQ} {decode.address} {20 + i}") == f"send {rid}"
        assert de.cmd(f"wait {rid} 60") == "Success"
        assert pe.cmd(f"wait {rid} 60") == "Success"
        assert pe.cmd(f"poll {rid}") == "Success"
        landed = de.cmd(f"digests {rid}")  # decode's memory at ITS lists
        assert landed == pe.cmd(f"digests {rid}"), rid  # == prefill's at ITS lists
        assert de.cmd(f"release {rid}") == "released"
    events = de.cmd("events")
    assert "r2:Bootstrapping" in events and "r2:Success" in events, events
    _no_grpc(pe, de)
    with KvbeamClient(decode.address) as d:  # released: nothing held
        assert d.status("r2").state is TransferState.SUCCESS
        assert d.capacity().slots_held == 0


def _cli_status(address: str, rid: str) -> dict[str, Any]:
    r = run_cli("status", "--address", address, "--request-id", rid, "--json")
    assert r.returncode in (0, 1), r.stderr
    return cast(dict[str, Any], json.loads(r.stdout))


def test_status_shows_what_an_engine_list_request_moved_after_it_ended(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    """``kvbeam status`` of a request the engines named by lists (no slot): its bytes
    (equal to what each daemon counted in /metrics), its lists' lengths (what the
    layout needs for its tokens), how it was verified and when it entered each state,
    on both sides, still after decode's release and prefill's forgetting it; and a
    failed one's. Before, it read ``slot=-1 bytes=0/0`` once the request ended."""
    prefill, decode, pe, de = engines
    before = {d.role: value(scrape(d.metrics), "kvbeam_request_bytes_total")
              for d in (prefill, decode)}
    assert de.cmd(f"reserve s1 {SEQ} {prefill.address} 7") == "reserve s1"
    assert pe.cmd(f"send s1 {SEQ} {decode.address} 8") == "send s1"
    assert de.cmd("wait s1 60") == "Success" and pe.cmd("wait s1 60") == "Success"
    assert de.cmd("release s1") == "released"
    time.sleep(1.0)  # prefill's sweep (every 0.2 s) forgets its record of the request
    config = side()
    used = kind_items(build_side_layout(config))  # the kinds the layout has buffers of
    want = {k.value: n for k, n in expected_lengths(config.target, SEQ).items() if k in used}
    moved = {d.role: value(scrape(d.metrics), "kvbeam_request_bytes_total") - before[d.role]
             for d in (prefill, decode)}
    for daemon, verified in ((prefill, "XXH3-128 digests of "),
                             (decode, "XXH3-128 verified: ")):
        st = _cli_status(daemon.address, "s1")
        assert st["state"] == "Success" and st["slot"] == -1, st
        assert st["bytes_done"] == st["bytes_total"] == moved[daemon.role] > 0, (st, moved)
        assert st["lists"] == want, st["lists"]
        assert st["verification"].startswith(verified), st["verification"]
        states = [state for state, _ in st["timeline"]]
        assert states == ["Bootstrapping", "WaitingForInput", "Transferring", "Success"], st
        times = [after for _, after in st["timeline"]]
        assert times == sorted(times) and times[-1] > 0, st["timeline"]
    text = run_cli("status", "--address", decode.address, "--request-id", "s1").stdout
    assert f"bytes={moved['decode']:.0f}/{moved['decode']:.0f} peer=" in text, text
    assert "slot=" not in text and "  verification: XXH3-128 verified: " in text, text
    assert "  timeline: Bootstrapping 0.0 ms -> WaitingForInput " in text, text

    # A reservation that ended unfilled: nothing landed of what it reserved.
    assert de.cmd(f"reserve s2 {SEQ} {prefill.address} 9") == "reserve s2"
    assert de.cmd("abort s2") == "aborted"
    assert de.cmd("wait s2 30").startswith("Failed")
    st = _cli_status(decode.address, "s2")
    assert st["reason"] == "aborted" and st["bytes_done"] == 0, st
    assert st["bytes_total"] == moved["decode"], st  # the same lengths: the same bytes
    assert [state for state, _ in st["timeline"]][-1] == "Failed", st


def test_engines_attached_for_final_pushes_hear_only_of_the_ends(tmp_path: Path) -> None:
    """``attach(pushes="final")`` (what the vLLM and sglang integrations ask): the bytes
    move as before, and each engine is pushed Success or Failed only, not the states
    between; decode's Failed still comes once its pages are free."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    with attached_pair(tmp_path, cfg, [*FAST, "--send-wait-s", "3"], pushes="final") as (
            prefill, decode, pe, de):
        for i in range(2):
            rid = f"f{i}"
            assert de.cmd(f"reserve {rid} {SEQ} {prefill.address} {30 + i}") == f"reserve {rid}"
            assert de.cmd(f"poll {rid}") == "Bootstrapping"  # nothing pushed before the end
            assert pe.cmd(f"send {rid} {SEQ} {decode.address} {40 + i}") == f"send {rid}"
            assert de.cmd(f"wait {rid} 60") == "Success"
            assert pe.cmd(f"wait {rid} 60") == "Success"
            assert de.cmd(f"digests {rid}") == pe.cmd(f"digests {rid}"), rid
            assert de.cmd(f"release {rid}") == "released"
        assert de.cmd("events") == "events f0:Success,f1:Success"
        assert pe.cmd("events") == "events f0:Success,f1:Success"
        assert de.cmd(f"reserve gone {SEQ} {prefill.address} 50") == "reserve gone"
        assert de.cmd("abort gone") == "aborted"
        assert de.cmd("wait gone 30").startswith("Failed aborted"), de.cmd("poll gone")
        assert de.cmd("events") == "events gone:Failed"
        with KvbeamClient(decode.address) as d:  # the daemon's own record has every state
            assert d.status("f1").state is TransferState.SUCCESS


def test_a_refused_frame_fails_the_request_with_the_daemons_reason(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    prefill, _decode, _pe, de = engines
    de.cmd(f"reserve bad {SEQ} no-port 1")
    answer = de.cmd("wait bad 10")
    assert answer.startswith("Failed invalid_request: prefill_address: "), answer
    # The channel still serves after the refusal.
    assert de.cmd(f"reserve ok {SEQ} {prefill.address} 2") == "reserve ok"
    assert de.cmd("poll ok") in ("Bootstrapping", "WaitingForInput"), de.cmd("poll ok")


def test_a_refused_frame_of_a_live_request_is_an_error_not_a_state(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    """An early RELEASE and a second RESERVE of a live id are refused, and the request is
    still the daemon's: not Failed at the engine (whose Failed means "the pages are free":
    prefill may still write them), and it moves when prefill sends."""
    prefill, decode, pe, de = engines
    assert de.cmd(f"reserve live {SEQ} {prefill.address} 7") == "reserve live"
    assert de.cmd("release live") == "released"  # before Success: refused
    assert _until_refused(de, "live").startswith("refusal release: BadRequest: "), \
        de.cmd("refusal live")
    assert de.cmd(f"reserve live {SEQ} {prefill.address} 7") == "reserve live"  # again
    assert "already holds" in _until_refused(de, "live", "release"), de.cmd("refusal live")
    assert de.cmd("poll live") in ("Bootstrapping", "WaitingForInput"), de.cmd("poll live")
    assert pe.cmd(f"send live {SEQ} {decode.address} 8") == "send live"
    assert de.cmd("wait live 60") == "Success"
    assert pe.cmd("wait live 60") == "Success"
    assert de.cmd("digests live") == pe.cmd("digests live")
    assert de.cmd("release live") == "released"


def _until_refused(engine: ChannelEngine, rid: str, before: str = "") -> str:
    """The engine's refusal of ``rid`` once there is one (not starting with ``before``)."""
    answer = ""
    for _ in range(300):
        answer = engine.cmd(f"refusal {rid}")
        if answer != "refusal" and not (before and answer.startswith(f"refusal {before}")):
            return answer
        time.sleep(0.05)
    return answer


def test_a_dropped_engine_socket_fails_the_peers_request(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    prefill, decode, pe, de = engines
    assert de.cmd(f"reserve gone {SEQ} {prefill.address} 3") == "reserve gone"
    de.proc.kill()
    de.proc.wait(10)
    with KvbeamClient(decode.address) as d:
        st = d.wait("gone", 30)
        assert st.state is TransferState.FAILED and "detached" in st.detail, str(st)
    pe.cmd(f"send gone {SEQ} {decode.address} 4")
    answer = pe.cmd("wait gone 30")
    assert answer.startswith("Failed "), answer


def _until(engine: ChannelEngine, rid: str, want: str, tries: int = 300) -> str:
    answer = ""
    for _ in range(tries):
        answer = engine.cmd(f"poll {rid}")
        if answer.startswith(want):
            return answer
        time.sleep(0.05)
    return answer


def test_a_send_before_the_reservation_waits_for_it(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    prefill, decode, pe, de = engines
    for i in range(2):  # the first before any handshake, the second over a live link
        rid = f"early{i}"
        assert pe.cmd(f"send {rid} {SEQ} {decode.address} {30 + i}") == f"send {rid}"
        assert _until(pe, rid, "WaitingForInput") == "WaitingForInput"
        assert de.cmd(f"reserve {rid} {SEQ} {prefill.address} {40 + i}") == f"reserve {rid}"
        assert de.cmd(f"wait {rid} 60") == "Success"
        assert pe.cmd(f"wait {rid} 60") == "Success"
        assert de.cmd(f"digests {rid}") == pe.cmd(f"digests {rid}"), rid
        de.cmd(f"release {rid}")


def test_a_send_nobody_reserves_fails_when_its_lease_runs_out(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    _prefill, decode, pe, _de = engines
    pe.cmd(f"send lonely {SEQ} {decode.address} 5")
    answer = pe.cmd("wait lonely 30")
    assert answer.startswith("Failed timeout: no progress in WaitingForInput for 3.0 s "
                             "(decode's reservation"), answer


def test_an_abort_while_waiting_for_the_reservation_fails_it(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    _prefill, decode, pe, _de = engines
    pe.cmd(f"send quit {SEQ} {decode.address} 6")
    assert _until(pe, "quit", "WaitingForInput") == "WaitingForInput"
    pe.cmd("abort quit")
    answer = pe.cmd("wait quit 10")
    assert answer.startswith("Failed aborted: aborted by the test engine"), answer


def test_an_aborted_offered_reservation_is_failed_once_its_pages_may_be_reused(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    """Decode pushes Failed for an aborted reservation prefill was offered only once its
    pages are free: prefill may have begun writing them, so decode first has prefill
    drain (its Abort's answer) and frees them then. An engine that hands them to its
    next request as soon as it sees Failed is accepted, and that request moves."""
    prefill, decode, pe, de = engines
    # A first request links the pair (the next reservations are offered over the link).
    assert de.cmd(f"reserve warm {SEQ} {prefill.address} 50") == "reserve warm"
    pe.cmd(f"send warm {SEQ} {decode.address} 51")
    assert de.cmd("wait warm 60") == "Success"
    de.cmd("release warm")
    for i in range(3):
        rid, new = f"offered{i}", f"reused{i}"
        before = value(scrape(prefill.metrics), "kvbeam_offers_total", event="received")
        assert de.cmd(f"reserve {rid} {SEQ} {prefill.address} {60 + i}") == f"reserve {rid}"
        for _ in range(600):  # prefill holds decode's offer (nothing is sent yet)
            if value(scrape(prefill.metrics), "kvbeam_offers_total",
                     event="received") > before:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"prefill never received the offer of {rid}")
        answer = de.cmd(f"reuse {rid} {new} {SEQ} {prefill.address}")
        assert answer.startswith("Failed aborted: aborted by the test engine"), answer
        # The new reservation at the same pages was accepted and moves.
        pe.cmd(f"send {new} {SEQ} {decode.address} {70 + i}")
        assert de.cmd(f"wait {new} 60") == "Success", de.cmd(f"poll {new}")
        assert pe.cmd(f"wait {new} 60") == "Success"
        assert de.cmd(f"digests {new}") == pe.cmd(f"digests {new}"), new
        de.cmd(f"release {new}")


#: SEQ's three chunks of one 256-token page each: (kv_offset, start, end, final).
CHUNKS = ((0, 0, 256, 0), (1, 256, 512, 0), (2, 512, SEQ, 1))


def _written(prefill: DaemonProcess, rid: str) -> int:
    """Bytes of ``rid`` prefill's writes completed (0 until the first chunk's did)."""
    with KvbeamClient(prefill.address) as p:
        return p.status(rid).bytes_done


def _until_written(prefill: DaemonProcess, rid: str) -> int:
    for _ in range(600):
        done = _written(prefill, rid)
        if done:
            return done
        time.sleep(0.05)
    raise AssertionError(f"no write of {rid} completed")


def test_a_request_sent_chunk_by_chunk_moves_each_chunk_as_it_comes(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    """Each SEND gives its chunk's pages (kv_offset); prefill writes them at once, and
    decode is Success only once the final chunk (with the states) landed and verified."""
    prefill, decode, pe, de = engines
    for i in range(2):  # the first handshakes; the second over the pair's link
        rid = f"chunked{i}"
        assert de.cmd(f"reserve {rid} {SEQ} {prefill.address} {80 + i}") == f"reserve {rid}"
        offset, start, end, _ = CHUNKS[0]
        assert pe.cmd(f"chunk {rid} {SEQ} {decode.address} {90 + i} {offset} {start} {end} 0"
                      ) == f"chunk {rid}"
        first = _until_written(prefill, rid)  # chunk 0 moved before chunk 1 exists
        offset, start, end, _ = CHUNKS[1]
        pe.cmd(f"chunk {rid} {SEQ} {decode.address} {90 + i} {offset} {start} {end} 0")
        for _ in range(600):
            if _written(prefill, rid) > first:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"chunk 1 of {rid} was not written")
        # Two of three chunks landed: no Success without the final chunk.
        assert de.cmd(f"wait {rid} 1") in ("Bootstrapping", "WaitingForInput", "Transferring")
        offset, start, end, _ = CHUNKS[2]
        pe.cmd(f"chunk {rid} {SEQ} {decode.address} {90 + i} {offset} {start} {end} 1")
        assert de.cmd(f"wait {rid} 60") == "Success"
        assert pe.cmd(f"wait {rid} 60") == "Success"
        assert de.cmd(f"digests {rid}") == pe.cmd(f"digests {rid}"), rid
        de.cmd(f"release {rid}")
    _no_grpc(pe, de)


def test_a_request_sent_layer_by_layer_moves_each_layer_as_it_comes(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    """LAYERS: a SEND makes the request's pages ready in the model's first layers only;
    prefill writes those layers' KV at once (decode holds them, not the later layers'),
    and decode is Success only once the final chunk landed and was verified."""
    move_layer_by_layer(*engines, "layered")


def move_layer_by_layer(prefill: DaemonProcess, decode: DaemonProcess, pe: ChannelEngine,
                        de: ChannelEngine, rid: str, wait_s: int = 60,
                        config: SideConfig | None = None) -> None:
    """Reserve ``rid``, send it ready in 2 layers and check only those layers' KV
    landed, then in every layer, then the final chunk: Success and every digest equal
    (the RDMA suite runs it over soft-RoCE: tests/rdma/test_layers_rdma.py). ``config``:
    the engines' (default :func:`side`)."""
    config = config or side()
    lay = build_side_layout(config)
    kv_layers = lay.kv_layers  # the KV buffers come first in the digests' order
    assert de.cmd(f"reserve {rid} {SEQ} {prefill.address} 95") == f"reserve {rid}"
    assert pe.cmd(f"layers {rid} {SEQ} {decode.address} 96 2") == f"layers {rid}"
    _until_written(prefill, rid)
    src, dst = pe.cmd(f"digests {rid}").split()[1].split(","), \
        de.cmd(f"digests {rid}").split()[1].split(",")
    ready = [i for i, layer in enumerate(kv_layers) if layer < 2]
    later = [i for i, layer in enumerate(kv_layers) if layer >= 2]
    assert ready and later, kv_layers
    assert [src[i] for i in ready] == [dst[i] for i in ready], "layers [0, 2) did not move"
    assert all(src[i] != dst[i] for i in later), "a layer moved before it was ready"
    assert de.cmd(f"wait {rid} 1") in ("Bootstrapping", "WaitingForInput", "Transferring")
    assert pe.cmd(f"layers {rid} {SEQ} {decode.address} 96 {lay.num_layers}") == f"layers {rid}"
    pages = expected_lengths(config.target, SEQ)[IndexKind.KV_PAGES]
    pe.cmd(f"chunk {rid} {SEQ} {decode.address} 96 {pages} {SEQ} {SEQ} 1")
    assert de.cmd(f"wait {rid} {wait_s}", wait_s + 10) == "Success"
    assert pe.cmd(f"wait {rid} {wait_s}", wait_s + 10) == "Success"
    assert de.cmd(f"digests {rid}") == pe.cmd(f"digests {rid}")
    de.cmd(f"release {rid}")
    _no_grpc(pe, de)


#: A model whose KV buffers go layer by layer (ratio 4 in every layer) and that decode's
#: 64 KiB sub-batches cut: the first sub-batch is layers 0-1's KV, the second layers
#: 2-3's, the other three hold states (whole with the final chunk only).
LAYERED = side(head_dim=128, compression_ratios=(4, 4, 4, 4))
SUB_BATCHES = ["--verify-sub-batch-mib", "0.0625"]


def test_a_request_sent_layer_by_layer_is_verified_as_its_layers_land(
        tmp_path: Path) -> None:
    """Integrity per piece: each sub-batch's mark goes with the chunk that makes it
    whole, so decode digests layers 0-1 once they landed, then 2-3, and only the states
    after the final chunk; prefill digested them as early."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", LAYERED)
    with attached_pair(tmp_path, cfg, [*FAST, "--send-wait-s", "3", *SUB_BATCHES]) as four:
        move_marked_layers(*four, "marked")


def move_marked_layers(prefill: DaemonProcess, decode: DaemonProcess, pe: ChannelEngine,
                       de: ChannelEngine, rid: str, wait_s: int = 60) -> None:
    """:func:`move_layer_by_layer` of a :data:`LAYERED` request into a decode that
    advertised :data:`SUB_BATCHES`; both logs say each sub-batch was marked and digested
    as it landed, layers 0-1's with the first piece (the RDMA suite runs it over two
    QPs: tests/rdma/test_layers_rdma.py)."""
    move_layer_by_layer(prefill, decode, pe, de, rid, wait_s, config=LAYERED)
    # The first piece marks layers 0-1's sub-batch; the piece of every layer marks 2-3's
    # unless it came while a step ran (then it is one step with the final chunk); the
    # final chunk marks the rest.
    chunks = re.findall(rf"request {rid}: posted (final chunk|chunk), .*?\((\d+) "
                        r"sub-batches marked (?:whole in this chunk|before the last, "
                        r"(\d+) in this chunk)\)", prefill.output)
    assert chunks and chunks[0] == ("chunk", "1", ""), chunks
    assert chunks[-1][:2] == ("final chunk", "5"), chunks
    assert sum(int(now or marks) for _, marks, now in chunks) == 5, chunks
    assert wait_until(lambda: "5 of 6 sub-batches digested as they landed" in decode.output,
                      10), decode.output[-3000:]


def test_a_byte_flipped_in_a_layer_piece_fails_the_request(tmp_path: Path) -> None:
    """The negative control: decode flips a landed byte of every sub-batch (layers 0-1's
    among them, verified before the final chunk came) and the request fails integrity,
    on decode and on prefill."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", LAYERED)
    env = {CORRUPT_LANDED_ENV: "1", SEED_ENV: "3"}
    with attached_pair(tmp_path, cfg, [*FAST, "--send-wait-s", "3", *SUB_BATCHES,
                                       ENABLE_FLAG], env=env) as (prefill, decode, pe, de):
        lay = build_side_layout(LAYERED)
        assert de.cmd(f"reserve flip {SEQ} {prefill.address} 95") == "reserve flip"
        for layers in (2, lay.num_layers):
            assert pe.cmd(f"layers flip {SEQ} {decode.address} 96 {layers}") == "layers flip"
        pages = expected_lengths(LAYERED.target, SEQ)[IndexKind.KV_PAGES]
        pe.cmd(f"chunk flip {SEQ} {decode.address} 96 {pages} {SEQ} {SEQ} 1")
        answer = de.cmd("wait flip 60", 70)
        assert answer.startswith("Failed integrity"), answer
        with KvbeamClient(decode.address) as d:
            assert "XXH3-128 mismatch" in d.status("flip").detail
        assert decode.output.count("FAULT INJECTED: corrupted") > 1, decode.output[-3000:]
        assert pe.cmd("wait flip 60", 70).startswith("Failed"), pe.cmd("poll flip")


@pytest.mark.parametrize(("second", "field"), [
    ("2 512 700 1", "kv_offset: request bad: its KV pages continue at position 1, this "
                    "piece starts at 2"),  # a gap: piece 1 skipped
    ("0 0 256 0", "kv_offset: request bad: its KV pages continue at position 1, this piece "
                  "starts at 0"),  # a repeat (overlap)
])
def test_an_out_of_order_piece_is_refused_naming_the_field_and_frees_the_request(
        engines: tuple[DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine],
        second: str, field: str) -> None:
    prefill, decode, pe, de = engines
    assert de.cmd(f"reserve bad {SEQ} {prefill.address} 100") == "reserve bad"
    pe.cmd(f"chunk bad {SEQ} {decode.address} 101 0 0 256 0")
    pe.cmd(f"chunk bad {SEQ} {decode.address} 101 {second}")
    answer = pe.cmd("wait bad 30")
    # The refused piece is an error of that SEND (the engine reads it), and prefill,
    # which holds the request, aborts it (no later piece can complete it) and pushes
    # that Failed: its first chunk may have landed, so decode frees it once drained.
    assert pe.cmd("refusal bad").startswith(f"refusal {field.split(':')[0]}: "), \
        pe.cmd("refusal bad")
    assert field in pe.cmd("refusal bad")
    assert answer.startswith("Failed aborted: a SEND piece was refused: "), answer
    assert field in answer, answer
    assert de.cmd("wait bad 30").startswith("Failed "), de.cmd("poll bad")
    with KvbeamClient(decode.address) as d:
        assert d.capacity().slots_held == 0
    assert de.cmd(f"reserve again {SEQ} {prefill.address} 100") == "reserve again"
    pe.cmd(f"send again {SEQ} {decode.address} 102")
    answer = de.cmd("wait again 60")
    assert answer == "Success", f"{answer}\n--- decode ---\n{decode.output[-6000:]}\n" \
                                f"--- prefill ---\n{prefill.output[-6000:]}"


def test_an_abort_between_chunks_frees_both_sides(engines: tuple[
        DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]) -> None:
    prefill, decode, pe, de = engines
    assert de.cmd(f"reserve mid {SEQ} {prefill.address} 110") == "reserve mid"
    pe.cmd(f"chunk mid {SEQ} {decode.address} 111 0 0 256 0")
    _until_written(prefill, "mid")
    pe.cmd("abort mid")
    assert pe.cmd("wait mid 30").startswith("Failed aborted: aborted by the test engine")
    assert de.cmd("wait mid 30").startswith("Failed "), de.cmd("poll mid")
    with KvbeamClient(decode.address) as d, KvbeamClient(prefill.address) as p:
        assert d.capacity().slots_held == 0
        assert p.capacity().live_transfers == 0
    # Decode's pages are free for its engine's next request, which moves.
    assert de.cmd(f"reserve next {SEQ} {prefill.address} 110") == "reserve next"
    pe.cmd(f"send next {SEQ} {decode.address} 112")
    assert de.cmd("wait next 60") == "Success", de.cmd("poll next")
