"""The engine's contract and the attach socket under load, with real daemons (issue 45).

- A daemon SIGKILLed and started again with the same flags: the engines (``--reattach``)
  attach the same memory again, a request while it is down fails at once saying so, and
  a request after moves (digests equal on both sides). Each daemon in turn.
- Hostile clients on the attach socket: silent connections do not delay a real attach
  (and one past the cap is refused naming it); a client dripping its message does not
  delay an attached engine's frames; an oversize refusal and a deeply nested message are
  answered, bounded, in one log line; an engine that closes and attaches again at once
  is accepted 10 times of 10.
- A flood of 300,000 ABORT and DECLINE frames: the daemon's memory stays bounded, its
  health is answered during the flood, and a frame after it is answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.engine import AttachError, EnginePools, KVPoll, Receiver, attach
from kvbeam.procs import DaemonProcess
from kvbeam.proto import engine_frames as ef
from kvbeam.proto.attach_codec import MAX_ERROR_CHARS, MAX_MESSAGE_BYTES, config_to_mapping
from kvbeam.server.engines.attach import MAX_PENDING, READ_TIMEOUT_S
from tests.attach_helpers import start_engine_daemon, start_engine_pair, write_config
from tests.daemon_helpers import FAST
from tests.fixtures import side
from tests.host.test_engine_channel import ChannelEngine
from tests.waiting import wait_until

SEQ = 700


def _port(daemon: DaemonProcess) -> str:
    return daemon.address.rpartition(":")[2]


def _restart(daemon: DaemonProcess, sock: str) -> DaemonProcess:
    """SIGKILL ``daemon`` and start it again with the same flags (its port included)."""
    daemon.kill()
    return start_engine_daemon(daemon.role, sock, deadlines=[*FAST, "--send-wait-s", "3"],
                               extra=["--listen", f"127.0.0.1:{_port(daemon)}"])


def _move(pe: ChannelEngine, de: ChannelEngine, p: DaemonProcess, d: DaemonProcess,
          rid: str, seed: int) -> None:
    assert de.cmd(f"reserve {rid} {SEQ} {p.address} {seed}") == f"reserve {rid}"
    assert pe.cmd(f"send {rid} {SEQ} {d.address} {seed + 1}") == f"send {rid}"
    answer = de.cmd(f"wait {rid} 60")
    assert answer == "Success", f"{answer}\n--- decode ---\n{d.output[-4000:]}\n" \
                                f"--- prefill ---\n{p.output[-4000:]}"
    assert pe.cmd(f"wait {rid} 60") == "Success"
    assert de.cmd(f"digests {rid}") == pe.cmd(f"digests {rid}"), rid
    assert de.cmd(f"release {rid}") == "released"


def _reattached(engine: ChannelEngine, times: int) -> bool:
    return wait_until(lambda: engine.cmd("state").startswith(f"state 1 {times} "), 60)


def test_a_restarted_daemon_is_re_attached_and_requests_after_it_move(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    psock, dsock = str(tmp_path / "p.sock"), str(tmp_path / "d.sock")
    p, d = start_engine_pair(psock, dsock, deadlines=[*FAST, "--send-wait-s", "3"])
    pe = de = None
    try:
        pe = ChannelEngine(psock, cfg, 1, "final", reattach=True)
        de = ChannelEngine(dsock, cfg, 2, "final", reattach=True)
        _move(pe, de, p, d, "before", 10)
        for n, role in enumerate(("decode", "prefill"), start=1):
            engine = de if role == "decode" else pe
            victim = d if role == "decode" else p
            # In flight when the daemon dies: it fails (the channel closed).
            if role == "decode":
                assert de.cmd(f"reserve inflight{n} {SEQ} {p.address} 30") == \
                    f"reserve inflight{n}"
            else:
                assert pe.cmd(f"send inflight{n} {SEQ} {d.address} 30") == f"send inflight{n}"
            victim.kill()
            assert engine.cmd(f"wait inflight{n} 30").startswith("Failed shutdown: ")
            # While it is down: a new request fails at once, saying why.
            if role == "decode":
                de.cmd(f"reserve down{n} {SEQ} {p.address} 31")
            else:
                pe.cmd(f"send down{n} {SEQ} {d.address} 31")
            answer = engine.cmd(f"poll down{n}")
            assert answer.startswith("Failed shutdown: ") and "unreachable" in answer \
                and "re-attaching" in answer, answer
            restarted = _restart(victim, dsock if role == "decode" else psock)
            if role == "decode":
                d = restarted
            else:
                p = restarted
            assert _reattached(engine, 1), engine.cmd("state")
            with KvbeamClient(restarted.address) as c:
                assert c.wait_healthy(30)
            _move(pe, de, p, d, f"after{n}", 40 + 10 * n)
            _move(pe, de, p, d, f"again{n}", 41 + 10 * n)
    finally:
        for e in (pe, de):
            if e is not None:
                e.stop()
        p.stop()
        d.stop()


# ---- the attach socket under hostile clients -----------------------------------------
@pytest.fixture
def decode(tmp_path: Path) -> Iterator[tuple[DaemonProcess, str]]:
    """A ``--pools engine`` decode daemon and its attach socket."""
    tmp_path.chmod(0o700)
    sock = str(tmp_path / "d.sock")
    daemon = start_engine_daemon("decode", sock)
    try:
        yield daemon, sock
    finally:
        daemon.stop()


def _connect(sock: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock)
    return s


def _reply(s: socket.socket, timeout: float = 30.0) -> dict[str, object]:
    s.settimeout(timeout)
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack("<I", buf[:4])[0]:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    out: dict[str, object] = json.loads(buf[4:])
    return out


def _unanswered(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b"x"  # never: data or EOF means answered
    except BlockingIOError:
        return True
    finally:
        s.setblocking(True)


def test_silent_clients_do_not_delay_a_real_attach_and_a_crowd_is_refused_by_name(
        decode: tuple[DaemonProcess, str]) -> None:
    daemon, sock = decode
    silent = [_connect(sock) for _ in range(5)]
    try:
        with EnginePools(side()) as pools:
            t0 = time.monotonic()
            att = attach(sock, pools, timeout=30)
            took = time.monotonic() - t0
            # Attached while every silent client still waits for its deadline (before
            # issue 45 the attach thread read them one by one, 5 s each, first).
            assert all(_unanswered(s) for s in silent)
            silent += [_connect(sock) for _ in range(MAX_PENDING - len(silent))]
            extra = _connect(sock)  # one past the cap: refused at once, by name
            reply = _reply(extra, 10)
            extra.close()
            assert reply["ok"] is False and reply["field"] == "connections", reply
            assert f"{MAX_PENDING} connections are already sending" in str(reply["error"])
            att.detach()
        print(f"\nreal attach with 5 silent clients connected: {took * 1000:.0f} ms "
              f"(their deadline {READ_TIMEOUT_S:g} s)")
        for s in silent:  # each is cut off at its own deadline, answered
            reply = _reply(s, READ_TIMEOUT_S + 30)
            assert reply["ok"] is False and "within" in str(reply["error"]), reply
    finally:
        for s in silent:
            s.close()
    assert "Traceback" not in daemon.output


def test_an_engine_attaching_into_a_crowd_waits_for_room_within_its_timeout(
        decode: tuple[DaemonProcess, str]) -> None:
    """The crowd refusal is one the engine library tries again (within attach's timeout):
    a real engine attaches once the silent connections' deadline frees the room."""
    _daemon, sock = decode
    silent = [_connect(sock) for _ in range(MAX_PENDING)]
    try:
        with EnginePools(side()) as pools:
            att = attach(sock, pools, timeout=READ_TIMEOUT_S + 30)
            assert att.attached
            att.detach()
    finally:
        for s in silent:
            s.close()


def test_a_slow_attacher_does_not_delay_the_attached_engines_frames(
        decode: tuple[DaemonProcess, str]) -> None:
    _daemon, sock = decode
    with EnginePools(side()) as pools, attach(sock, pools, pushes="final") as att:
        slow = _connect(sock)
        slow.sendall(struct.pack("<I", 200) + b"{")  # and then one byte at a time
        stop = threading.Event()

        def drip() -> None:
            while not stop.wait(0.05):
                with contextlib.suppress(OSError):
                    slow.send(b" ")

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            answered = []
            for i in range(20):  # each refused at once (no such prefill): Failed pushed
                r = Receiver(att, f"r{i}", "no-port")
                t0 = time.monotonic()
                r.send_metadata([i], seq_len=10)
                assert r.wait(30) is KVPoll.Failed, r.poll()
                answered.append(time.monotonic() - t0)
            assert _unanswered(slow)  # still dripping: its message is not whole yet
        finally:
            stop.set()
            dripper.join(5)
            slow.close()
    print(f"\nframes answered while a client dripped its attach message: max "
          f"{max(answered) * 1000:.1f} ms, median {sorted(answered)[10] * 1000:.1f} ms")


def _raw_attach(sock: str, body: bytes) -> dict[str, object]:
    s = _connect(sock)
    try:
        with contextlib.suppress(OSError):  # refused before all of it was read
            s.sendall(struct.pack("<I", len(body)) + body)
        return _reply(s)
    finally:
        s.close()


def test_oversize_and_nested_messages_get_a_bounded_answer_and_one_log_line(
        decode: tuple[DaemonProcess, str]) -> None:
    daemon, sock = decode
    huge = {"version": 1, "op": "attach", "memory_kind": "host_shm",
            "config": ["x" * 64] * (MAX_MESSAGE_BYTES // 80), "components": []}
    body = json.dumps(huge).encode()
    assert MAX_MESSAGE_BYTES // 2 < len(body) <= MAX_MESSAGE_BYTES
    cases = {
        "huge config": body,
        "nested": b"[" * 500_000 + b"]" * 500_000,
        "bad utf-8": b'{"version": 1, "op": "\xff"}',
        "deep config": json.dumps({**huge, "config": _deep_config()}).encode(),
    }
    for name, raw in cases.items():
        before = len(daemon.lines)
        reply = _raw_attach(sock, raw)
        assert reply["ok"] is False, (name, reply)
        assert len(json.dumps(reply)) < MAX_ERROR_CHARS + 400, (name, len(json.dumps(reply)))
        assert wait_until(lambda b=before: len(daemon.lines) > b, 10), name
        logged = [line for line in daemon.lines[before:] if "refused" in line]
        assert len(logged) == 1 and len(logged[0]) < 1000, (name, logged)
        print(f"\n{name}: {len(raw)} bytes -> {reply['field'] or '-'}: {reply['error']}")
    oversize = struct.pack("<I", MAX_MESSAGE_BYTES + 1)
    s = _connect(sock)
    s.sendall(oversize)
    reply = _reply(s)
    s.close()
    assert reply["ok"] is False and "exceeds" in str(reply["error"]), reply
    assert "Traceback" not in daemon.output, daemon.output[-3000:]
    with EnginePools(side()) as pools, attach(sock, pools):  # it still serves
        pass


def _deep_config() -> dict[str, object]:
    """A valid side config whose target.head_dim is a list nested 900 deep (within the
    JSON decoder's depth: the checks after it see it)."""
    mapping = config_to_mapping(side())
    mapping["target"]["head_dim"] = json.loads("[" * 900 + "1" + "]" * 900)
    return mapping


def test_an_engine_that_closes_and_attaches_again_at_once_is_accepted_every_time(
        decode: tuple[DaemonProcess, str]) -> None:
    daemon, sock = decode
    accepted = 0
    with EnginePools(side()) as pools:
        for i in range(10):
            att = attach(sock, pools, pushes="final")
            r = Receiver(att, f"held{i}", "127.0.0.1:1")  # live when the engine closes
            r.send_metadata([i], seq_len=10)
            att.close()
            try:
                again = attach(sock, pools, pushes="final", timeout=30)
            except AttachError as exc:  # counted, then asserted below
                print(f"re-attach {i}: {exc}")
                continue
            accepted += 1
            again.detach()
    print(f"\nimmediate re-attaches accepted: {accepted}/10")
    assert accepted == 10
    assert "another engine" not in daemon.output


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_flood_of_aborts_and_declines_leaves_the_daemon_bounded_and_answering(
        decode: tuple[DaemonProcess, str]) -> None:
    daemon, sock = decode
    pid = daemon.proc.pid
    n_aborts, n_declines = 200_000, 100_000
    with EnginePools(side()) as pools, KvbeamClient(daemon.address) as client:
        att = attach(sock, pools, pushes="final")
        assert att.channel is not None
        base = _rss_mib(pid)
        peak = [base]
        health: list[float] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.05):
                peak[0] = max(peak[0], _rss_mib(pid))
                t0 = time.monotonic()
                assert client.healthy(30)
                health.append(time.monotonic() - t0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        flood = b"".join(ef.encode(ef.Abort(f"a{i}", "flood")) for i in range(n_aborts))
        flood += b"".join(ef.encode(ef.Decline(f"d{i}", "127.0.0.1:1", "flood"))
                          for i in range(n_declines))
        logging_level = _quiet_engine_log()
        try:
            t0 = time.monotonic()
            att.channel.send_raw(flood)
            written = time.monotonic() - t0
            marker = Receiver(att, "marker", "no-port")  # refused at once: Failed pushed
            marker.send_metadata([0], seq_len=10)
            assert marker.wait(120) is KVPoll.Failed
            answered = time.monotonic() - t0
        finally:
            stop.set()
            watcher.join(35)
            _restore_engine_log(logging_level)
        att.detach()
    grew = peak[0] - base
    print(f"\n{n_aborts} ABORTs + {n_declines} DECLINEs: written in {written:.1f} s, the "
          f"frame after them answered {answered:.1f} s after the first; daemon RSS "
          f"{base:.0f} -> peak {peak[0]:.0f} MiB (+{grew:.0f}); health answered "
          f"{len(health)} times during the flood, slowest {max(health) * 1000:.0f} ms")
    assert health, "no health call was answered during the flood"
    # Unbounded, the same flood held every frame in the executor's queue: +700 MiB on
    # the 2-core host (issue 45). Bounded, what is read but not handled is one read.
    assert grew < 150, grew


def _quiet_engine_log() -> int:
    """The engine library logs every refusal (300k here): keep the test's log readable."""
    import logging

    logger = logging.getLogger("kvbeam.engine.channel")
    level = logger.level
    logger.setLevel(logging.ERROR)
    return level


def _restore_engine_log(level: int) -> None:
    import logging

    logging.getLogger("kvbeam.engine.channel").setLevel(level)


def test_the_attach_socket_listens_with_room_for_a_burst(
        decode: tuple[DaemonProcess, str]) -> None:
    """Forty engines connecting at once all get an answer (the backlog and the pending
    cap hold them): none fails to connect."""
    _daemon, sock = decode
    conns = [_connect(sock) for _ in range(40)]
    try:
        for s in conns:
            # One refused beyond the pending cap may be closed before we write: its
            # answer ("connections") is already in our socket, read below.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(struct.pack("<I", 2) + b"{}")
        replies = [_reply(s, 30) for s in conns]
    finally:
        for s in conns:
            s.close()
    fields = {str(r["field"]) for r in replies}
    assert all(r["ok"] is False for r in replies) and fields <= {"version", "connections"}, \
        fields
    assert os.path.exists(sock)
