"""kvbeam's sglang backend without daemons: KVArgs, index mapping, selection, rendezvous.

Needs sglang 0.5.23 installed (``make sglang``; ``make setup`` does it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import yaml

from kvbeam.engine import EngineBuffers, EnginePools
from kvbeam.errors import AttachError, ConfigError
from kvbeam.integrations.sglang import bootstrap, select
from kvbeam.integrations.sglang.kvargs import (
    buffers_from_kvargs,
    check_kvargs,
    state_index_lists,
)
from kvbeam.pools.checks import SAME_UNIFIED
from kvbeam.pools.layout import build_side_layout
from kvbeam.proto.attach_codec import config_to_mapping
from kvbeam.refengine.configs import tiny_config
from tests.sglang_helpers import sglang_utils_surface
from tests.sglang_kvargs import kvargs_for


def test_kvargs_pointers_become_the_pools_fds_and_offsets() -> None:
    with EnginePools(tiny_config(unified=True, draft=True)) as pools:
        args = kvargs_for(pools)
        check_kvargs(args, pools.layout)
        got = buffers_from_kvargs(args)
        try:
            want = pools.buffers()
            assert len(got.fds) == len(want.fds)

            def places(b: EngineBuffers) -> list[list[tuple[int, int, int, int]]]:
                # The same file (by inode; fd numbers differ: dups), offset, sizes.
                return [[(os.fstat(b.fds[r.fd_index]).st_ino, r.offset, r.length, r.item_len)
                         for r in c] for c in b.components]

            assert places(got) == places(want)
        finally:
            for fd in got.fds:
                os.close(fd)


def test_kvargs_in_private_memory_is_refused_naming_the_buffer() -> None:
    with EnginePools(tiny_config(unified=False, draft=False)) as pools:
        args = kvargs_for(pools)
        private = np.zeros(args.kv_data_lens[0], dtype=np.uint8)
        args.kv_data_ptrs[0] = int(private.ctypes.data)
        with pytest.raises(AttachError, match=r"component 0 buffer 0 .* not in shareable memory"):
            buffers_from_kvargs(args)


def test_kvargs_that_do_not_match_the_config_are_refused() -> None:
    with EnginePools(tiny_config(unified=True, draft=True)) as pools:
        args = kvargs_for(pools)
        args.state_types = args.state_types[:-1]
        args.state_data_ptrs, args.state_data_lens, args.state_item_lens = (
            x[:-1] for x in (args.state_data_ptrs, args.state_data_lens, args.state_item_lens))
        with pytest.raises(AttachError, match="do not match the kvbeam config") as info:
            check_kvargs(args, pools.layout)
        assert info.value.field == "state_types"
        args = kvargs_for(pools)
        args.kv_item_lens[0] += 1
        with pytest.raises(AttachError, match=r"component 0 \(kv\)"):
            check_kvargs(args, pools.layout)


def test_positional_state_indices_map_to_kinds_draft_last() -> None:
    layout = build_side_layout(tiny_config(unified=True, draft=True))
    names = [c.name for c in layout.states]
    assert names[-1] == "draft.swa_ring"
    entries: list[object] = []
    for comp in layout.states:
        kinds = sorted({b.index_kind.name for b in comp.buffers})
        entries.append({k: [1] for k in kinds} if len(kinds) > 1 else [7])
    lists = state_index_lists(layout, [*entries[:-1], None])
    assert "draft.SWA_RING_ROWS" not in lists and lists["SWA_RING_ROWS"] == [7]
    lists = state_index_lists(layout, entries)
    assert lists["draft.SWA_RING_ROWS"] == [7]
    paged = build_side_layout(tiny_config(unified=False, draft=True))
    multi = next(c for c in paged.states if len({b.index_kind for b in c.buffers}) > 1)
    bad = [[1] if c is multi else None for c in paged.states]
    with pytest.raises(ValueError, match="pass a mapping kind -> list"):
        state_index_lists(paged, bad)


def test_mismatched_draft_is_refused_at_construction_with_sglangs_wording(
        tmp_path: Path) -> None:
    from kvbeam.integrations.sglang.conn import KvbeamKVManager

    data = config_to_mapping(tiny_config(unified=True, draft=True))
    data["draft"]["unified_kv"] = False
    cfg = tmp_path / "side.yaml"
    cfg.write_text(yaml.safe_dump(data))
    from kvbeam.pools.spec import SideConfig

    with EnginePools(SideConfig.from_mapping(data, "bad")) as pools:
        args = SimpleNamespace(kvbeam_config=str(cfg), kvbeam_daemon="127.0.0.1:1",
                               kvbeam_attach_socket=str(tmp_path / "none.sock"))
        with pytest.raises(RuntimeError, match=f"^{SAME_UNIFIED}: target=True, draft=False"):
            KvbeamKVManager(kvargs_for(pools), "decode", args)


def test_the_backend_enum_resolves_to_kvbeams_classes() -> None:
    from kvbeam.integrations.sglang import conn

    utils = sglang_utils_surface()
    choices = ["mooncake", "nixl"]
    select.install(utils, choices)
    select.install(utils, choices)  # idempotent
    backend = utils.TransferBackend("kvbeam")
    assert backend.name == "KVBEAM" and backend in list(utils.TransferBackend)
    kinds = utils.KVClassType
    assert utils.get_kv_class(backend, kinds.MANAGER) is conn.KvbeamKVManager
    assert utils.get_kv_class(backend, kinds.SENDER) is conn.KvbeamKVSender
    assert utils.get_kv_class(backend, kinds.RECEIVER) is conn.KvbeamKVReceiver
    assert utils.get_kv_class(backend, kinds.BOOTSTRAP_SERVER) is conn.KvbeamKVBootstrapServer
    from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs

    assert issubclass(conn.KvbeamKVManager, BaseKVManager)
    assert utils.get_kv_class(backend, kinds.KVARGS) is KVArgs  # sglang's own container
    assert choices == ["mooncake", "nixl", "kvbeam"]
    # The other backends still resolve through sglang's function.
    with pytest.raises(ValueError, match="Unsupported transfer backend"):
        utils.get_kv_class("nope", kinds.MANAGER)


def test_moved_internals_fail_loudly_naming_the_version() -> None:
    moved = ModuleType("sglang.srt.disaggregation.utils")
    with pytest.raises(select.SglangMismatch, match=r"expects sglang 0\.5\.23 .*TransferBackend"):
        select.install(moved, [])
    utils = sglang_utils_surface()
    del utils.get_kv_class
    with pytest.raises(select.SglangMismatch, match=r"0\.5\.23 .*get_kv_class is missing"):
        select.install(utils, [])


def test_missing_sglang_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "kvbeam.integrations.sglang.conn", raising=False)
    monkeypatch.setitem(sys.modules, "sglang.srt.disaggregation.base.conn", None)
    with pytest.raises(ImportError, match=r"needs sglang 0\.5\.23 \(`make sglang`"):
        import kvbeam.integrations.sglang.conn  # noqa: F401


def test_bootstrap_store_round_trip() -> None:
    server = bootstrap.BootstrapServer("127.0.0.1", 0)
    try:
        assert bootstrap.call(server.address, "get", "room.1") is None
        bootstrap.call(server.address, "put", "room.1", {"lists": {"KV_PAGES": [3, 1]}})
        assert bootstrap.call(server.address, "get", "room.1") == {"lists": {"KV_PAGES": [3, 1]}}
        assert bootstrap.call(server.address, "delete", "room.1") is not None
        assert bootstrap.call(server.address, "get", "room.1") is None
        with pytest.raises(RuntimeError, match="unknown op 'drop'"):
            bootstrap.call(server.address, "drop", "room.1")
    finally:
        server.close()


@pytest.mark.parametrize(("value", "opens"), [("true", True), ("1", True), ("on", True),
                                              ("false", False), ("no", False)])
def test_bootstrap_server_reads_kvbeam_insecure_as_the_daemons_do(
        monkeypatch: pytest.MonkeyPatch, value: str, opens: bool) -> None:
    from kvbeam.integrations.sglang import conn
    monkeypatch.delenv("KVBEAM_AUTH_TOKEN_FILE", raising=False)
    monkeypatch.setenv("KVBEAM_INSECURE", value)
    if opens:
        conn.KvbeamKVBootstrapServer("0.0.0.0", 0).close()
    else:
        with pytest.raises(ConfigError, match="without a token"):
            conn.KvbeamKVBootstrapServer("0.0.0.0", 0)


@pytest.mark.parametrize("value", ["maybe", "", "ture"])
def test_a_bad_kvbeam_insecure_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                    value: str) -> None:
    # As the daemons refuse it (server/settings.py): a typo must not quietly mean false.
    from kvbeam.integrations.sglang import conn
    monkeypatch.delenv("KVBEAM_AUTH_TOKEN_FILE", raising=False)
    monkeypatch.setenv("KVBEAM_INSECURE", value)
    with pytest.raises(ConfigError, match=f"KVBEAM_INSECURE: not a boolean: {value!r}"):
        conn.KvbeamKVBootstrapServer("127.0.0.1", 0)


class _LazyModule(ModuleType):
    """A module that imports on attribute access (transformers' lazy modules do)."""

    touched: ClassVar[list[str]] = []

    def __getattr__(self, name: str) -> object:
        self.touched.append(name)
        raise RuntimeError(f"lazy import of {name} triggered")


def test_install_reads_module_namespaces_without_lazy_imports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A real sglang server's sys.modules holds transformers' lazy modules: looking
    # get_kv_class up with getattr() imported (and failed on) their models.
    monkeypatch.setitem(sys.modules, "kvbeam_test_lazy", _LazyModule("kvbeam_test_lazy"))
    monkeypatch.setitem(sys.modules, "kvbeam_test_none", None)  # a blocked import
    utils = sglang_utils_surface()
    original = utils.get_kv_class
    by_name = ModuleType("kvbeam_test_by_name")
    by_name.get_kv_class = original  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvbeam_test_by_name", by_name)
    select.install(utils, [])
    assert _LazyModule.touched == []
    assert by_name.get_kv_class is utils.get_kv_class is not original


def test_the_sglang_plugin_entry_point_is_declared_and_loads() -> None:
    import tomllib

    from kvbeam.integrations.sglang import plugin

    root = Path(__file__).resolve().parents[2]
    eps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]
    name, _, value = plugin.ENTRY_POINT.partition(" = ")
    assert eps[plugin.ENTRY_POINT_GROUP] == {name: value}
    module, _, attr = value.partition(":")
    import importlib

    assert getattr(importlib.import_module(module), attr) is plugin.load


def test_while_the_daemon_is_away_sglangs_polls_read_failed_at_once(tmp_path: Path) -> None:
    """The manager's attachment re-attaches (a real Attachment against a fake daemon); in
    between, a receiver's and a sender's polls read Failed at once (not at a deadline),
    and the failure names the unreachable daemon."""
    from kvbeam.engine import attach
    from kvbeam.engine.attach import Reattach
    from kvbeam.integrations.sglang.conn import KvbeamKVReceiver, KvbeamKVSender
    from kvbeam.integrations.sglang.scheduler import PREFILL_KEY
    from tests.unit.test_engine_reattach import FakeDaemon
    from tests.waiting import wait_until

    config = tiny_config(unified=True, draft=True)
    layout = build_side_layout(config)
    rooms: dict[str, object] = {PREFILL_KEY: {"daemon": "127.0.0.1:8"}}

    def store(_address: str, op: str, key: str, value: object = None,
              timeout: float = 10.0, ttl: float | None = None) -> object:
        present = rooms.get(key)
        if op == "put" or (op == "add" and present is None):
            rooms[key] = value
        elif op == "delete":
            rooms.pop(key, None)
        return present if op == "add" else rooms.get(key)

    lists = {"KV_PAGES": [0], "SWA_RING_ROWS": list(range(32)), "REQ_SLOT": [0],
             "C128_STATE": [0]}
    states = [None if c.pool == "draft" else
              {k: lists[k] for k in sorted({b.index_kind.name for b in c.buffers})}
              for c in layout.states]
    daemon = FakeDaemon(str(tmp_path / "d.sock"), [])
    with EnginePools(config) as pools:
        att = attach(daemon.path, pools, reattach=Reattach(30.0, 30.0))  # no try meanwhile
        daemon.drop()
        assert wait_until(lambda: att.reattaching, 10.0, 0.01)
        from kvbeam.integrations.sglang.conn import KvbeamKVManager

        mgr: Any = object.__new__(KvbeamKVManager)  # its request-side members, no attach
        mgr.__dict__.update(attachment=att, config=config, layout=layout, mode="decode",
                            daemon="127.0.0.1:9", store=store, bootstrap_timeout=300.0,
                            waiting_timeout=300.0, tombstone_ttl=600.0, _peer_checks={},
                            _store_warned={})
        rx = KvbeamKVReceiver(mgr, "boot:1", 7)
        rx.init(0)
        rx.send_metadata(np.array([0], dtype=np.int32), 0, states)
        assert rx.poll() == 0  # KVPoll.Failed, at once
        with pytest.raises(RuntimeError, match=r"unreachable.*re-attaching"):
            rx.failure_exception()
        tx = KvbeamKVSender(mgr, "boot:1", 7)
        tx.init(1, 0)
        tx.send(np.array([0], dtype=np.int32), states, num_kv_tokens=100)
        assert tx.poll() == 0
        with pytest.raises(RuntimeError, match="unreachable"):
            tx.failure_exception()
        att.close()
    daemon.close()
