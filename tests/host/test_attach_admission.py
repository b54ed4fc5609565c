"""Who may reach the attach socket, and for how long (an AttachServer in this process,
clients in subprocesses of another uid).

A stranger is refused on its credentials before the daemon reads a byte: one that
sends nothing gets the refusal at once, not after the read timeout. Letting another uid
attach does not make the socket world-writable (``--attach-group``: group-only). An
allowed engine that sends its message slowly is cut off when the whole message's
deadline passes, whatever its pace.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvbeam.errors import AttachError
from kvbeam.proto.attach_codec import AttachRequest
from kvbeam.server.engines.attach import READ_TIMEOUT_S, AttachServer, PeerCred

NOBODY = pwd.getpwnam("nobody")
GROUP = grp.getgrgid(NOBODY.pw_gid).gr_name  # nobody's own group (nogroup)

#: Run as ``nobody`` (member of GROUP only): connect, send nothing, print the reply.
_SILENT_STRANGER = """
import json, os, socket, struct, sys, time
os.setgroups([]); os.setgid({gid}); os.setuid({uid})
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.settimeout(30)
t0 = time.monotonic()
buf = b""
while len(buf) < 4 or len(buf) < 4 + struct.unpack("<I", buf[:4])[0]:
    chunk = s.recv(65536)
    if not chunk:
        break
    buf += chunk
print(json.dumps({{"elapsed_s": time.monotonic() - t0,
                   "reply": json.loads(buf[4:]) if len(buf) > 4 else None}}))
"""


def _refuse(req: AttachRequest, fds: list[int], cred: PeerCred) -> str:
    for fd in fds:
        os.close(fd)
    raise AttachError("this test attaches nothing", "op")


@pytest.fixture
def serve() -> Iterator[Callable[..., AttachServer]]:
    """Start AttachServers on sockets in a directory nobody's group may traverse (under
    /tmp: pytest's own temporary directories are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="kvbeam-admission-"))
    path.chmod(0o710)
    os.chown(path, -1, NOBODY.pw_gid)
    servers: list[AttachServer] = []

    def start(name: str, allow_uids: tuple[int, ...] = (), group: str = "") -> AttachServer:
        server = AttachServer(str(path / name), allow_uids, _refuse, lambda _: None,
                              group=group)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
def test_a_stranger_is_refused_before_the_daemon_reads_anything(
        serve: Callable[..., AttachServer]) -> None:
    # nobody may open the socket (its group), but its uid is not allowed.
    server = serve("d.sock", group=GROUP)
    script = _SILENT_STRANGER.format(uid=NOBODY.pw_uid, gid=NOBODY.pw_gid)
    out = subprocess.run([sys.executable, "-c", script, server.path], capture_output=True,
                         text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    print(f"\nsilent stranger answered after {answer['elapsed_s']:.3f} s "
          f"(read timeout {READ_TIMEOUT_S} s): {answer['reply']}")
    reply = answer["reply"]
    # It sent nothing: a daemon that read first could only answer "unreadable ... timed out".
    assert reply is not None and not reply["ok"], answer
    assert reply["field"] == "peer_uid", reply
    assert f"peer uid {NOBODY.pw_uid}" in reply["error"] and "--attach-allow-uid" in \
        reply["error"], reply


def test_allowing_another_uid_never_makes_the_socket_world_writable(
        serve: Callable[..., AttachServer]) -> None:
    alone = serve("alone.sock", allow_uids=(NOBODY.pw_uid,))
    grouped = serve("grouped.sock", allow_uids=(NOBODY.pw_uid,), group=GROUP)
    modes = {s.path: stat.S_IMODE(os.stat(s.path).st_mode) for s in (alone, grouped)}
    assert modes == {alone.path: 0o600, grouped.path: 0o660}, {k: oct(v)
                                                                for k, v in modes.items()}
    assert os.stat(grouped.path).st_gid == NOBODY.pw_gid


def test_an_unknown_attach_group_stops_the_server_naming_it(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    with pytest.raises(AttachError, match="--attach-group no-such-group-kvbeam: no such group"):
        AttachServer(str(tmp_path / "x.sock"), (), _refuse, lambda _: None,
                     group="no-such-group-kvbeam")
    assert not (tmp_path / "x.sock").exists()


def test_a_slow_engine_cannot_hold_the_attach_thread_past_the_read_timeout(
        serve: Callable[..., AttachServer]) -> None:
    server = serve("slow.sock")
    body = 60
    drip_s = 0.25  # one byte at a time: each within the timeout, the whole far beyond it
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(server.path)
    conn.settimeout(drip_s)
    conn.sendall(struct.pack("<I", body))
    t0 = time.monotonic()
    sent, reply = 0, b""
    try:
        while sent < body and not reply:
            try:
                conn.sendall(b" ")
                sent += 1
            except OSError:
                break  # the daemon closed: its answer is waiting
            with contextlib.suppress(TimeoutError):
                reply = conn.recv(65536)
        conn.settimeout(10)
        while len(reply) < 4 or len(reply) < 4 + struct.unpack("<I", reply[:4])[0]:
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    finally:
        conn.close()
    elapsed = time.monotonic() - t0
    answer = json.loads(reply[4:])
    print(f"\nslow engine cut off after {elapsed:.1f} s, {sent} of {body} bytes sent: {answer}")
    assert sent < body, (sent, answer)
    assert not answer["ok"] and "unreadable attach message" in answer["error"], answer
    assert f"within {READ_TIMEOUT_S:g} s" in answer["error"], answer
