"""A peer in another process, for tests and benchmarks of the transports.

:class:`PeerProcess` spawns (never forks) a process that opens a transport,
holds one anonymous-mmap buffer filled with a byte, registers it, and answers
commands over a pipe: its endpoint, connect, events, read/fill bytes, write.
It imports neither torch nor pytest.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import multiprocessing as mp
import os
import sys
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbeam.transport.base import Access, Event, EventKind, Link, Transport
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.endpoint import Endpoint, Region
from kvbeam.transport.options import TransportOptions


@dataclass(frozen=True)
class PeerConfig:
    """What the peer process opens and registers."""

    kind: str  # "rdma" or "tcp"
    nbytes: int
    access: Access
    fill: int = 0
    device: str | None = None
    gid_index: int | None = None
    options: TransportOptions | None = None


def buffer_address(buf: mmap.mmap) -> int:
    """The address of an mmap buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def random_source(nbytes: int, seed: int) -> tuple[mmap.mmap, int]:
    """A source buffer of ``nbytes`` seeded random bytes, and its address."""
    buf = mmap.mmap(-1, nbytes)
    buf.write(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    return buf, buffer_address(buf)


def rdma_peer(device: str, gid_index: int, nbytes: int, fill: int,
              options: TransportOptions) -> PeerProcess:
    """A peer process owning a remote-writable, ``fill``-filled RDMA buffer."""
    return PeerProcess(PeerConfig("rdma", nbytes, Access.REMOTE_WRITE, fill=fill,
                                  device=device, gid_index=gid_index, options=options))


def open_for_test(kind: str, device: str | None, gid_index: int | None,
                  options: TransportOptions | None) -> Transport:
    """The transport a test asked for (never silently TCP when RDMA was asked for)."""
    from kvbeam.transport.factory import open_transport

    if kind not in ("rdma", "tcp"):
        raise ValueError(kind)
    return open_transport("rdma" if kind == "rdma" else "tcp", device, gid_index,
                          options=options)


class PeerProcess:
    """Parent-side handle of a spawned peer."""

    def __init__(self, config: PeerConfig, timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.timeout = timeout
        self.process = ctx.Process(target=_peer_main, args=(child, config), daemon=True)
        self.process.start()
        child.close()
        self.endpoint: Endpoint = self._reply()
        self.addr: int = self.call("addr")

    def call(self, *command: Any, timeout: float | None = None) -> Any:
        """Send one command and return its reply (re-raising the peer's exception)."""
        self._conn.send(command)
        return self._reply(timeout)

    def connect(self, peer: Endpoint) -> None:
        """Connect the peer's link to ``peer``."""
        self.call("connect", peer)

    def events(self, count: int, timeout: float, kind: EventKind | None = None) -> list[Event]:
        """Wait in the peer until it has ``count`` events (of ``kind``) or ``timeout`` passed.

        With ``kind``, events of other kinds are dropped.
        """
        result: list[Event] = self.call("events", count, timeout, kind,
                                        timeout=timeout + self.timeout)
        return result

    def new_link(self) -> Endpoint:
        """Release the peer's link and create a new one; its endpoint, for a new handshake."""
        endpoint: Endpoint = self.call("new_link")
        return endpoint

    def write(self, transfer_id: int, src_offsets: list[int], dst: list[int], lengths: list[int],
              notify: bool = True) -> None:
        """Have the peer write from its buffer (offsets) to our addresses."""
        self.call("write", transfer_id, src_offsets, dst, lengths, notify)

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of the peer's buffer."""
        data: bytes = self.call("read", offset, length)
        return data

    def kill(self) -> None:
        """SIGKILL the peer (a crash, as far as the transport can tell)."""
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        """Ask the peer to exit, kill it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("exit",))
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self._conn.close()

    def _reply(self, timeout: float | None = None) -> Any:
        if not self._conn.poll(self.timeout if timeout is None else timeout):
            raise TimeoutError("peer process did not answer")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"peer process failed: {value}")
        return value


def _peer_main(conn: Connection, config: PeerConfig) -> None:
    logging.basicConfig(level=os.environ.get("KVBEAM_PEER_LOG", "WARNING"), stream=sys.stderr,
                        format=f"peer[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    buf = mmap.mmap(-1, config.nbytes)
    if config.fill:
        buf.write(bytes([config.fill]) * config.nbytes)
    addr = buffer_address(buf)
    transport = open_for_test(config.kind, config.device, config.gid_index, config.options)
    transport.register([Region(addr, config.nbytes)], config.access)
    links = [transport.create_link()]
    conn.send(("ok", links[0].endpoint))
    pending: list[Event] = []
    try:
        while True:
            command = conn.recv()
            if command[0] == "exit":
                break
            try:
                reply = _serve(command, transport, links, buf, addr, pending)
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send(("ok", reply))
    except EOFError:
        pass
    finally:
        transport.close()


def _serve(command: tuple[Any, ...], transport: Transport, links: list[Link], buf: mmap.mmap,
           addr: int, pending: list[Event]) -> Any:
    name = command[0]
    link = links[0]
    if name == "addr":
        return addr
    if name == "release_link":  # destroy the link (its QP), keep the process
        link.release()
        return None
    if name == "new_link":  # release the link and create another: a fresh handshake
        link.release()
        links[0] = transport.create_link()
        return links[0].endpoint
    if name == "clear":
        pending.extend(transport.events(0))
        pending.clear()
        return None
    if name == "connect":
        link.connect(command[1])
        return None
    if name == "events":
        count, timeout, kind = command[1], command[2], command[3]
        deadline = time.monotonic() + timeout
        while True:
            if kind is not None:
                pending[:] = [e for e in pending if e.kind is kind]
            if len(pending) >= count or time.monotonic() >= deadline:
                break
            pending.extend(transport.events(max(0.0, deadline - time.monotonic())))
        out = pending[:count]
        del pending[:count]
        return out
    if name == "read":
        offset, length = command[1], command[2]
        end = len(buf) if length is None else offset + length
        return bytes(buf[offset:end])
    if name == "crc":
        offset, length = command[1], command[2]
        return zlib.crc32(memoryview(buf)[offset:offset + length])
    if name == "fill":
        offset, data = command[1], command[2]
        buf[offset:offset + len(data)] = data
        return None
    if name == "write":  # ("write", transfer_id, src_offsets, dst_addrs, lengths, notify)
        _, transfer_id, src_off, dst, lengths, notify = command
        src = np.asarray(src_off, dtype=np.uint64) + np.uint64(addr)
        link.write(transfer_id, Blocks(src, np.asarray(dst, dtype=np.uint64),
                                       np.asarray(lengths, dtype=np.uint64)), notify)
        return None
    raise ValueError(f"unknown command {name!r}")
