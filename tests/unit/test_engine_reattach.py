"""An attachment re-attaches to a daemon that went away (kvbeam.engine.attach, Reattach),
against a fake daemon in this process: a Unix socket that answers attach messages as
told (attach, refuse) and can drop the attached connection."""

from __future__ import annotations

import importlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbeam.engine import EnginePools, KVPoll, Receiver, attach
from kvbeam.engine.attach import Reattach
from kvbeam.proto import engine_frames as ef
from kvbeam.proto.attach_codec import AttachReply, frame, read_message, reply_to_json
from kvbeam.states import FailureReason
from tests.fixtures import side
from tests.waiting import wait_until

FAST = Reattach(first_delay_s=0.02, max_delay_s=0.1, timeout_s=5)


class FakeDaemon:
    """Answers each connection with the next of ``answers`` (``attach`` or ``refuse``;
    ``attach`` once they run out; ``refuse`` whatever they say while :attr:`refusing`),
    keeps the attached connection, counts the fds."""

    def __init__(self, path: str, answers: list[str]) -> None:
        self.path = path
        self.answers = answers
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.attached: list[socket.socket] = []
        self.fds_seen: list[int] = []
        self.connections = 0
        self.refusing = False
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(5)
            _, fds = read_message(conn, with_fds=True)
            self.fds_seen.append(len(fds))
            for fd in fds:
                os.close(fd)
            answer = self.answers.pop(0) if self.answers else "attach"
            if self.refusing:
                answer = "refuse"
            if answer == "refuse":
                conn.sendall(frame(reply_to_json(AttachReply(False, "not now", "op"))))
                conn.close()
                continue
            # Kept before the reply: the engine's attach() returns on the reply, and a test
            # that then drops the connection must find it here.
            self.attached.append(conn)
            conn.sendall(frame(reply_to_json(AttachReply(
                True, instance_id=f"i{self.connections}", channel=ef.ENGINE_FRAMES_VERSION))))

    def drop(self) -> None:
        """The daemon went away: close the attached connection."""
        self.attached.pop().close()

    def frames(self, conn: socket.socket, n: int) -> list[object]:
        buf = ef.FrameBuffer()
        out: list[bytes] = []
        conn.settimeout(5)
        while len(out) < n:
            out += buf.feed(conn.recv(65536))
        return [ef.decode(b) for b in out]

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        for conn in self.attached:
            conn.close()




@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "fake.sock")


def test_the_backoff_doubles_up_to_its_cap_and_stops_after_max_tries() -> None:
    assert list(Reattach(0.1, 0.5, max_tries=5).waits()) == [0.1, 0.2, 0.4, 0.5, 0.5]
    endless = Reattach(1.0, 4.0).waits()
    assert [next(endless) for _ in range(6)] == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def test_a_lost_daemon_is_re_attached_with_the_same_memory_and_requests_move_again(
        sock_path: str) -> None:
    daemon = FakeDaemon(sock_path, [])
    with EnginePools(side()) as pools:
        nfds = len(pools.fds)
        fds_before = len(os.listdir("/proc/self/fd"))
        att = attach(sock_path, pools, reattach=FAST)
        assert att.instance_id == "i1" and att.attached
        inflight = Receiver(att, "r1", "p:1")
        inflight.send_metadata([1], seq_len=10)
        old = att.channel
        daemon.refusing = True  # the restarted daemon refuses for a while
        daemon.drop()
        # In flight: failed when the channel closed; new: failed at once, saying why.
        assert inflight.wait(5) is KVPoll.Failed
        assert wait_until(lambda: daemon.connections >= 3, 10.0, 0.01)  # two tries refused
        late = Receiver(att, "r2", "p:1")
        late.send_metadata([2], seq_len=10)
        assert late.poll() is KVPoll.Failed
        reason, detail = late.failure() or (None, "")
        assert reason is FailureReason.SHUTDOWN
        assert "is unreachable" in detail and "re-attaching" in detail, detail
        assert "attach refused by the daemon" in detail, detail  # the last try's error
        # Then the daemon takes the same memory again: a new channel.
        daemon.refusing = False
        assert wait_until(lambda: att.reattaches == 1, 10.0, 0.01), (daemon.connections,
                                                                      att.reattaching)
        assert daemon.fds_seen == [nfds] * daemon.connections
        assert att.instance_id == f"i{daemon.connections}" and att.attached
        assert not att.reattaching and att.channel is not old
        fresh = Receiver(att, "r3", "p:1")
        fresh.send_metadata([3], seq_len=10)
        (reserve,) = daemon.frames(daemon.attached[-1], 1)
        assert isinstance(reserve, ef.Reserve) and reserve.request_id == "r3"
        assert fresh.poll() is KVPoll.Bootstrapping
        tries = daemon.connections
        att.close()  # the engine's own close: no re-attach
        time.sleep(0.2)
        assert daemon.connections == tries and not att.reattaching
        # The duplicates are closed (the fake daemon's end of its connection is open).
        assert len(os.listdir("/proc/self/fd")) == fds_before + len(daemon.attached)
    daemon.close()


def test_closing_while_re_attaching_stops_it_and_a_policy_may_give_up(sock_path: str) -> None:
    with EnginePools(side()) as pools:
        fds_before = len(os.listdir("/proc/self/fd"))
        daemon = FakeDaemon(sock_path, [])
        att = attach(sock_path, pools, reattach=Reattach(0.02, 0.05, timeout_s=2, max_tries=3))
        daemon.close()  # the daemon is gone for good: nothing listens
        os.unlink(sock_path)
        assert wait_until(lambda: not att.reattaching and att.channel is not None
                          and "gave up" in att.channel.closed_reason, 10.0, 0.01)
        late = Receiver(att, "r", "p:1")
        late.send_metadata([1], seq_len=10)
        assert late.poll() is KVPoll.Failed
        assert "gave up re-attaching after 3 tries" in (late.failure() or (None, ""))[1]
        att.close()
        assert len(os.listdir("/proc/self/fd")) == fds_before
        # Closed in the middle of re-attaching: the thread stops, the fds are closed.
        daemon = FakeDaemon(sock_path, [])
        att = attach(sock_path, pools, reattach=Reattach(0.3, 0.3))
        daemon.refusing = True
        daemon.drop()
        assert wait_until(lambda: att.reattaching, 10.0, 0.01)
        att.close()
        assert wait_until(lambda: not att.reattaching, 10.0, 0.01)
        tries = daemon.connections
        time.sleep(1.0)  # past three tries' time: none came
        assert daemon.connections == tries
        daemon.close()
        assert len(os.listdir("/proc/self/fd")) == fds_before


@pytest.mark.timeout(30)  # the waits below that must end (no wall-clock assert)
def test_a_full_listen_backlog_is_retried_until_the_timeout(
        sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Unix socket's connect fails at once with EAGAIN while the listener's backlog is
    full: attach retries until its timeout instead of failing in milliseconds. The
    listener accepts only once attach has paused to try again (its module's
    ``time.sleep``, seen here): attach then ends attached, after that pause."""
    order: list[str] = []
    paused = threading.Event()
    attach_module = importlib.import_module("kvbeam.engine.attach")

    class SeenPauses:
        """kvbeam.engine.attach's ``time``: the real clock, its pauses recorded."""

        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            order.append("pause")
            paused.set()
            time.sleep(seconds)

    monkeypatch.setattr(attach_module, "time", SeenPauses)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(0)
    fillers = []
    for _ in range(8):  # fill the backlog: nothing accepts yet
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(sock_path)
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
    done = threading.Event()

    def serve_later() -> None:
        if not paused.wait(20):  # attach failed (or never retried): accept nothing
            return
        order.append("accept")
        for _ in range(len(fillers) + 1):
            conn, _ = listener.accept()
            conn.settimeout(5)
            try:
                read_message(conn, with_fds=True)
            except (OSError, EOFError):
                conn.close()  # a filler: it sent nothing
                continue
            conn.sendall(frame(reply_to_json(AttachReply(True, instance_id="late"))))
            done.wait(20)  # kept open until the test is done with the attachment
            conn.close()
            return

    for s in fillers:
        s.close()  # closed, but still queued in the backlog until accepted
    server = threading.Thread(target=serve_later, daemon=True)
    server.start()
    try:
        with EnginePools(side()) as pools:
            att = attach(sock_path, pools, timeout=10)
            order.append("attached")
            assert att.instance_id == "late"
            # Refused with EAGAIN, paused, tried again: attached only after the accept
            # (more pauses may come between: tries that found the backlog still full).
            assert order[0] == "pause" and "accept" in order and order[-1] == "attached", order
            att.close()
    finally:
        done.set()
    server.join(5)
    listener.close()
