"""Benchmark: the floor under a small request's latency through the engine channel, on
this machine, with none of kvbeam in it.

``bench_engine_channel`` times a 128-token request from the prefill engine's Send to the
decode engine seeing Success: four processes (two engines, two daemons), a Unix socket
between each engine and its daemon, TCP on loopback between the daemons, the request's
bytes moved once, its digests taken on both sides. This runs the same four processes,
the same sockets and the same bytes doing only what that path cannot do without,
in plain Python on blocking sockets:

1. the prefill engine writes a 64-byte frame to its daemon;
2. the prefill daemon's thread, woken by it, sends a 32-byte header and the request's
   bytes in one ``sendmsg`` (and, with integrity, the bytes' XXH3-128 in the header,
   computed first, as prefill's record travels with a small request's data);
3. the decode daemon's thread reads them into its memory, digests them and compares
   (integrity), sends an 8-byte ACK to prefill and a 16-byte frame to its engine;
4. the decode engine, waiting for that frame, takes the time; prefill's ACK thread
   tells the prefill engine (a 16-byte frame) as prefill's Success push does.

No reservation, no offer, no lists, no plan, no status table: the request as if the
offer were already at prefill. What the real path costs above these figures, in the
same run, is kvbeam's own work per request (docs/performance.md). Each engine is driven
by this process over pipes, as ``bench_engine_channel``'s router drives its engines.

Prints, with and without integrity: the median latency (ms) and each daemon's CPU per
request (ms), and the machine-readable line ``engine_small_request_floor_ms=N`` (with
integrity, as the daemons run by default).

Run: ``python -m tests.bench.bench_floor [--requests 300] [--bytes N]`` (``--bytes``
defaults to a 128-token request of the shipped configs, record included).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import xxhash

from tests.bench.bench_request import cpu_s
from tests.bench.line_process import LineProcess

ROOT = str(Path(__file__).resolve().parents[2])
SEND_FRAME = 64   # the engine's SEND (a 128-token request's, without its lists)
STATE_FRAME = 16  # a pushed state
HEADER = struct.Struct("<QQ16s")  # request number, payload bytes, digest (or zeros)
ACK = struct.Struct("<Q")


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError at EOF."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def request_bytes() -> int:
    """A 128-token request's bytes between the shipped prefill and decode configs
    (docker/config/*.yaml), the digest record's block included."""
    from kvbeam.pools.indices import request_indices
    from kvbeam.pools.layout import build_side_layout
    from kvbeam.pools.mailbox import record_size
    from kvbeam.pools.plan import build_plan
    from kvbeam.pools.spec import load_side_config
    from tests.fixtures import shipped_config

    src_cfg = load_side_config(shipped_config("prefill"))
    dst_cfg = load_side_config(shipped_config("decode"))
    src, dst = build_side_layout(src_cfg), build_side_layout(dst_cfg)
    plan = build_plan(src, [1 << 40] * len(src.flat_buffers),
                      request_indices(src_cfg.target, 0, 128), dst,
                      [1 << 40] * len(dst.flat_buffers),
                      request_indices(dst_cfg.target, 0, 128))
    return plan.blocks.total_bytes + record_size(len(src.flat_buffers))


# ---- the four processes ------------------------------------------------------------------
def _listen_unix(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    return server


def _connect_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(200):
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {path}")


def _decode_daemon(work: Path, nbytes: int, integrity: bool) -> None:
    """Land each request, check its digest, ACK it, tell the engine."""
    engines = _listen_unix(str(work / "d.sock"))
    data = socket.create_server(("127.0.0.1", 0))
    (work / "d.port").write_text(str(data.getsockname()[1]))
    print("ready", flush=True)
    peer, _ = data.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    engine, _ = engines.accept()
    memory = bytearray(nbytes)
    head = bytearray(HEADER.size)
    while True:
        try:
            recv_exact(peer, memoryview(head))
        except ConnectionError:
            return
        number, length, digest = HEADER.unpack(head)
        recv_exact(peer, memoryview(memory)[:length])
        ok = not integrity or xxhash.xxh3_128_digest(memory) == digest
        peer.sendall(ACK.pack(number))
        engine.sendall(struct.pack("<QQ", number, 4 if ok else 0))


def _prefill_daemon(work: Path, nbytes: int, integrity: bool) -> None:
    """Send each request the engine names; push its Success when decode ACKs it."""
    engines = _listen_unix(str(work / "p.sock"))
    print("ready", flush=True)
    engine, _ = engines.accept()
    peer = socket.create_connection(("127.0.0.1", int((work / "d.port").read_text())))
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    memory = os.urandom(nbytes)

    def acks() -> None:
        ack = bytearray(ACK.size)
        while True:
            try:
                recv_exact(peer, memoryview(ack))
            except (ConnectionError, OSError):
                return
            engine.sendall(struct.pack("<QQ", ACK.unpack(ack)[0], 4))

    threading.Thread(target=acks, daemon=True).start()
    frame = bytearray(SEND_FRAME)
    while True:
        try:
            recv_exact(engine, memoryview(frame))
        except ConnectionError:
            return
        number = struct.unpack_from("<Q", frame)[0]
        digest = xxhash.xxh3_128_digest(memory) if integrity else bytes(16)
        peer.sendmsg([HEADER.pack(number, nbytes, digest), memory])


def _engine(work: Path, role: str) -> None:
    """Commands on stdin: ``send N`` (prefill: time, then the frame), ``wait N``
    (either: until state N is pushed; decode prints the time it came)."""
    sock = _connect_unix(str(work / ("p.sock" if role == "prefill" else "d.sock")))
    print("ready", flush=True)
    pushed = bytearray(STATE_FRAME)
    for line in sys.stdin:
        op, number = line.split()
        if op == "send":
            t = time.monotonic()
            sock.sendall(struct.pack("<Q", int(number)).ljust(SEND_FRAME, b"\0"))
            print(f"{t:.9f}", flush=True)
        else:
            recv_exact(sock, memoryview(pushed))
            t = time.monotonic()
            got, state = struct.unpack("<QQ", pushed)
            print(f"{t:.9f} {got} {state}", flush=True)


# ---- the router ---------------------------------------------------------------------------
class _Proc(LineProcess):
    def __init__(self, role: str, work: Path, nbytes: int, integrity: bool) -> None:
        super().__init__("tests.bench.bench_floor",
                         ["--role", role, "--work", str(work), "--bytes", str(nbytes),
                          *([] if integrity else ["--no-integrity"])], "ready")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.terminate()
        self.proc.wait(10)


def floor(requests: int, nbytes: int, integrity: bool,
          idle_s: float = 0.0) -> tuple[float, float, float]:
    """``requests`` sequential requests of ``nbytes`` (after 20 warm-up ones), each sent
    ``idle_s`` after the one before ended: the median Send-to-Success ms, and the
    prefill and decode daemons' CPU ms per request."""
    work = Path(tempfile.mkdtemp(prefix="kvbeam-floor-"))
    procs: list[_Proc] = []
    try:
        for role in ("decode-daemon", "prefill-daemon", "decode", "prefill"):
            procs.append(_Proc(role, work, nbytes, integrity))
        decode_daemon, prefill_daemon, decode, prefill = procs
        lat = []
        cpu0: list[float] = []
        for i in range(20 + requests):
            if i == 20:
                cpu0 = [cpu_s(p.proc.pid) for p in (prefill_daemon, decode_daemon)]
            if idle_s:
                time.sleep(idle_s)
            t0 = float(prefill.cmd(f"send {i}"))
            t1, got, state = decode.cmd(f"wait {i}").split()
            if int(got) != i or int(state) != 4:
                raise RuntimeError(f"request {i}: decode saw request {got} in state {state}")
            prefill.cmd(f"wait {i}")
            if i >= 20:
                lat.append((float(t1) - t0) * 1000)
        cpu = [(cpu_s(p.proc.pid) - c) * 1000 / requests
               for p, c in zip((prefill_daemon, decode_daemon), cpu0, strict=True)]
        return statistics.median(lat), cpu[0], cpu[1]
    finally:
        for p in reversed(procs):
            p.stop()
        for name in ("p.sock", "d.sock", "d.port"):
            (work / name).unlink(missing_ok=True)
        work.rmdir()


def main() -> None:
    """Print the floor with and without integrity, then the machine-readable line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="also time requests each sent this long after the one before "
                             "ended (every process idle meanwhile)")
    parser.add_argument("--bytes", type=int, default=0,
                        help="bytes per request (default: a 128-token request of the "
                             "shipped configs, record included)")
    parser.add_argument("--role", choices=("prefill", "decode", "prefill-daemon",
                                           "decode-daemon"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--no-integrity", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        work, integrity = Path(args.work), not args.no_integrity
        if args.role == "decode-daemon":
            _decode_daemon(work, args.bytes, integrity)
        elif args.role == "prefill-daemon":
            _prefill_daemon(work, args.bytes, integrity)
        else:
            _engine(work, args.role)
        return
    nbytes = args.bytes or request_bytes()
    figures = {}
    for integrity in (False, True):
        figures[integrity] = floor(args.requests, nbytes, integrity)
        ms, p_cpu, d_cpu = figures[integrity]
        print(f"# floor, integrity {'on ' if integrity else 'off'}: {nbytes:,} bytes per "
              f"request, {args.requests} sequential: Send-to-Success median {ms:.3f} ms; "
              f"daemon CPU ms per request: prefill {p_cpu:.3f}, decode {d_cpu:.3f}")
    if args.idle_ms:
        ms, p_cpu, d_cpu = floor(args.requests // 2, nbytes, True, args.idle_ms / 1000)
        print(f"# floor, integrity on, each request {args.idle_ms:g} ms after the one before: "
              f"Send-to-Success median {ms:.3f} ms; daemon CPU ms per request: prefill "
              f"{p_cpu:.3f}, decode {d_cpu:.3f}")
    print(f"engine_small_request_floor_ms={figures[True][0]:.3f}")


if __name__ == "__main__":
    main()
