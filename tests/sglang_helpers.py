"""sglang's backend interface driven as sglang's schedulers drive it (host and RDMA tests).

:class:`SglangPair` starts a prefill and a decode daemon (``--pools engine``), allocates
each reference engine's pools in memfds, builds sglang's ``KVArgs`` from their
pointers and constructs kvbeam's sglang managers, which attach them, plus the bootstrap
server. :meth:`SglangPair.transfer` is a :data:`~kvbeam.refengine.run.Transfer` that
makes sglang's calls in the prefill and decode schedulers' order and records, per
call, the state sglang saw (:attr:`SglangPair.calls`).
"""

from __future__ import annotations
import __future__

import ast
import enum
import importlib.util
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Literal, Optional

import numpy as np
import yaml

from kvbeam.auth import Security
from kvbeam.engine import EnginePools
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.plan import IndexLists
from kvbeam.pools.spec import SideConfig
from kvbeam.procs import DaemonProcess, PendingDaemon, spawn_daemon
from kvbeam.proto.attach_codec import config_to_mapping
from tests.sglang_kvargs import kvargs_for

POLL_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring",
              4: "Success"}


def positional_states(layout: SideLayout, lists: IndexLists) -> list[Any]:
    """The reference engine's lists as sglang's positional ``state_indices`` (draft: None,
    it shares the target's allocator)."""
    out: list[Any] = []
    for comp in layout.states:
        kinds = sorted({b.index_kind for b in comp.buffers}, key=lambda k: k.name)
        if comp.pool == "draft" or not kinds:
            out.append(None)
        elif len(kinds) == 1:
            out.append(np.asarray(lists[kinds[0]], dtype=np.int32))
        else:
            out.append({k.name: np.asarray(lists[k], dtype=np.int32) for k in kinds})
    return out


class SglangPair:
    """Two ``--pools engine`` daemons, the engines' pools, sglang managers over them."""

    def __init__(self, config: SideConfig, transport: str = "tcp", timeout: float = 60.0,
                 chunk_tokens: int | None = None, extra: tuple[str, ...] = (),
                 security: Security | None = None) -> None:
        """``security``: what the daemons' readiness checks present (the daemons, managers
        and bootstrap server take their own credentials from ``extra`` and the
        environment, e.g. ``KVBEAM_AUTH_TOKEN_FILE``)."""
        self.config, self.timeout, self.chunk_tokens = config, timeout, chunk_tokens
        self.security = security
        self.calls: list[tuple[str, str, str, str]] = []
        self.decode_status: Any = None
        self.rooms = 0
        self._dir = tempfile.TemporaryDirectory(prefix="kvbeam-sglang-")
        work = Path(self._dir.name)
        os.chmod(work, 0o700)
        cfg = work / "side.yaml"
        cfg.write_text(yaml.safe_dump(config_to_mapping(config)))
        self.daemons: list[DaemonProcess] = []
        self.pending: list[PendingDaemon] = []
        self.managers: list[Any] = []
        self.prefill_pools = EnginePools(config)
        self.decode_pools = EnginePools(config)
        self.bootstrap: Any = None
        try:
            self._start(str(cfg), work, transport, extra)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: str, work: Path, transport: str, extra: tuple[str, ...]) -> None:
        from kvbeam.integrations.sglang.conn import KvbeamKVBootstrapServer, KvbeamKVManager

        socks = {role: str(work / f"{role}.sock") for role in ("prefill", "decode")}
        pending = {role: spawn_daemon(role, cfg, extra=["--pools", "engine", "--attach-socket",
                                                        socks[role], "--transport", transport,
                                                        *extra], security=self.security)
                   for role in ("decode", "prefill")}
        self.pending = list(pending.values())
        self.bootstrap = KvbeamKVBootstrapServer("127.0.0.1", 0)
        self.bootstrap_addr = self.bootstrap.server.address
        addresses: dict[str, str] = {}
        for role, pools in (("decode", self.decode_pools), ("prefill", self.prefill_pools)):
            # The daemon's address is known once it reports ready, which needs the
            # attach: the manager gets a placeholder and the address afterwards.
            args = SimpleNamespace(kvbeam_config=cfg, kvbeam_daemon="pending",
                                   kvbeam_attach_socket=socks[role], host="127.0.0.1",
                                   disaggregation_bootstrap_port=self.bootstrap_addr
                                   .rpartition(":")[2])
            mgr = KvbeamKVManager(kvargs_for(pools), role, args)
            self.managers.append(mgr)
            daemon = pending[role].ready()
            self.daemons.append(daemon)
            mgr.daemon = addresses[role] = daemon.address
        self.decode_mgr, self.prefill_mgr = self.managers
        self.prefill_mgr.register_to_bootstrap()

    def _record(self, side: str, call: str, kvbeam: str, obj: Any) -> int:
        state = int(obj.poll())
        if self.rooms == 1:  # the table shows the first request
            self.calls.append((side, call, kvbeam, POLL_NAMES[state]))
        return state

    def transfer(self, src: IndexLists, dst: IndexLists, seq_len: int,
                 before_send: Callable[[Any, Any], None] | None = None,
                 after_chunk: Callable[[Any], None] | None = None) -> None:
        """One request through sglang's calls, in the schedulers' order (``after_chunk``:
        called with the sender after each send but the last, as sglang computes the next)."""
        from kvbeam.integrations.sglang.conn import KvbeamKVReceiver, KvbeamKVSender
        from kvbeam.pools.types import IndexKind

        self.rooms += 1
        room, page = self.rooms, self.config.target.page_size
        rx = KvbeamKVReceiver(self.decode_mgr, self.bootstrap_addr, room)
        self._record("decode", "KVReceiver(mgr, addr, room)", "nothing yet", rx)
        rx.init(0)
        self._record("decode", "init(prefill_dp_rank)", "bootstrap get: prefill daemon and "
                     "its pools' description, compared with decode's", rx)
        tx = KvbeamKVSender(self.prefill_mgr, self.bootstrap_addr, room)
        src_pages = np.asarray(src[IndexKind.KV_PAGES], dtype=np.int32)
        tx.init(len(src_pages), 0)
        self._record("prefill", "init(num_pages, aux)", "room not posted yet", tx)
        rx.send_metadata(np.asarray(dst[IndexKind.KV_PAGES], dtype=np.int32), 0,
                         positional_states(self.decode_mgr.layout, dst))
        self._record("decode", "send_metadata(pages, aux, states)", "RESERVE frame to decode's "
                     "daemon + bootstrap put: daemon, seq_len", rx)
        self._record("prefill", "poll()", "bootstrap get: decode's daemon, seq_len", tx)
        if before_send is not None:
            before_send(tx, rx)
        step = self.chunk_tokens or seq_len
        starts = list(range(0, seq_len, step))
        for start in starts:
            end = min(seq_len, start + step)
            last = end == seq_len
            pages = src_pages[start // page: -(-end // page)]
            tx.send(pages, positional_states(self.prefill_mgr.layout, src) if last else None,
                    num_kv_tokens=end - start)
            self._record("prefill", f"send({len(pages)} pages, states={'yes' if last else 'None'}"
                         f", num_kv_tokens={end - start})",
                         "SEND frame (the chunk's pages, and the states)" if last
                         else "SEND frame (the chunk's pages)", tx)
            if not last and after_chunk is not None:
                after_chunk(tx)
        deadline = time.monotonic() + self.timeout
        while {tx.poll(), rx.poll()} - {4, 0} and time.monotonic() < deadline:
            time.sleep(0.01)
        ptx = self._record("prefill", "poll() until done", "pushed state", tx)
        prx = self._record("decode", "poll() until done", "pushed state (after XXH3-128 "
                           "check)", rx)
        self.decode_status = rx.request  # the daemon's last pushed state, before Release
        tx.clear()
        rx.clear()
        if self.rooms == 1:
            self.calls += [("prefill", "clear()", "bootstrap delete", "-"),
                           ("decode", "clear()", "RELEASE frame + bootstrap delete", "-")]
        if (ptx, prx) != (4, 4):
            tx_err = rx_err = ""
            for name, obj in (("prefill", tx), ("decode", rx)):
                try:
                    obj.failure_exception()
                except RuntimeError as exc:
                    tx_err, rx_err = (str(exc), rx_err) if name == "prefill" else (tx_err, str(exc))
            raise RuntimeError(f"room {room}: prefill {POLL_NAMES[ptx]} {tx_err}; "
                               f"decode {POLL_NAMES[prx]} {rx_err}")

    def table(self) -> str:
        """The recorded call sequence as a markdown table."""
        rows = ["| side | sglang call | kvbeam did | sglang saw (poll) |", "|---|---|---|---|"]
        rows += [f"| {a} | `{b}` | {c} | {d} |" for a, b, c, d in self.calls]
        return "\n".join(rows)

    def close(self) -> None:
        """Detach, stop the daemons and the bootstrap server, free the pools."""
        for mgr in self.managers:
            mgr.close()
        for d in self.daemons:
            d.stop()
        for p in self.pending:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(10)
        if self.bootstrap is not None:
            self.bootstrap.close()
        self.prefill_pools.close()
        self.decode_pools.close()
        self._dir.cleanup()

    def __enter__(self) -> SglangPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sglang_utils_surface() -> ModuleType:
    """sglang's own ``TransferBackend``, ``KVClassType`` and ``get_kv_class``, from its
    ``disaggregation/utils.py`` source.

    That module cannot be imported without a GPU stack (its model configs pull
    torchvision), so the three definitions :mod:`kvbeam.integrations.sglang.select`
    touches are taken from the installed file unchanged (``@overload`` stubs left out)
    and executed in a fresh module.
    """
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None, "sglang is not installed"
    path = Path(spec.origin).parent / "srt" / "disaggregation" / "utils.py"
    tree = ast.parse(path.read_text(), str(path))
    keep: list[ast.stmt] = []
    for node in tree.body:
        enum_def = isinstance(node, ast.ClassDef) and node.name in ("TransferBackend",
                                                                     "KVClassType")
        function = isinstance(node, ast.FunctionDef) and node.name == "get_kv_class" and not any(
            isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list)
        if enum_def or function:
            keep.append(node)
    assert len(keep) == 3, f"{path}: {[getattr(n, 'name', '?') for n in keep]}"
    module = ModuleType("sglang.srt.disaggregation.utils")
    module.__dict__.update(Enum=enum.Enum, Optional=Optional, Type=type, Literal=Literal)
    code = compile(ast.Module(keep, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, module.__dict__)
    return module
