"""The pieces sglang's own servers need from kvbeam's backend, without a server.

Shareable pool memory (:mod:`kvbeam.integrations.sglang.memory`), the scheduler members
and poll states (:mod:`kvbeam.integrations.sglang.scheduler`), the metadata row's list.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kvbeam.auth import Security
from kvbeam.engine import SharedMemory
from kvbeam.errors import AuthenticationError
from kvbeam.integrations.sglang import bootstrap
from kvbeam.integrations.sglang.kvargs import buffers_from_kvargs, check_kvargs
from kvbeam.integrations.sglang.memory import share_tensors
from kvbeam.integrations.sglang.scheduler import (
    PREFILL_KEY,
    ManagerMembers,
    PrefillInfo,
    aux_lists,
    prefill_poll,
)
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.sglang_mha import sglang_mha_side_config, sglang_mha_spec
from kvbeam.pools.shm import shared_file_size

AUX = (64, 128)


def _layout(rows: int = 9, aux_rows: int = 4):  # type: ignore[no-untyped-def]
    return build_side_layout(sglang_mha_side_config("m", sglang_mha_spec(
        num_layers=2, page_size=1, num_kv_heads=2, head_dim=4, dtype="float16",
        token_rows=rows, aux_item_lens=AUX, aux_rows=aux_rows)))


def test_fused_k_v_halves_move_into_one_sealed_memfd_keeping_their_views() -> None:
    # sglang's MHATokenToKVPool: per layer one (2, rows, heads, dim) tensor, K = [0], V = [1].
    fused = [torch.zeros((2, 9, 2, 4), dtype=torch.float16) for _ in range(2)]
    k, v = [f[0, :9] for f in fused], [f[1, :9] for f in fused]
    shared = SharedMemory()
    try:
        moved = share_tensors([*k, *v], "test.kv", shared)
        assert len(shared.fds) == 2  # one memfd per layer's storage, K and V share it
        for old, new in zip([*k, *v], moved, strict=True):
            assert new is not None
            assert (new.shape, new.stride(), new.storage_offset(), new.dtype) == (
                old.shape, old.stride(), old.storage_offset(), old.dtype)
        assert moved[0] is not None and moved[2] is not None
        assert moved[2].data_ptr() - moved[0].data_ptr() == 9 * 2 * 4 * 2  # V after K
        moved[0][3] = 7.0
        assert float(moved[0][3, 1, 2]) == 7.0  # writable, the same bytes
        for fd in shared.fds:  # sealed: what the daemon's attach requires
            assert shared_file_size(fd, "test") == 2 * 9 * 2 * 4 * 2
        # And KVArgs built from the moved tensors attach as the sglang_mha layout.
        aux = share_tensors([torch.zeros((4, n // 4), dtype=torch.int32) for n in AUX],
                            "test.aux", shared)
        args = SimpleNamespace(
            kv_data_ptrs=[t.data_ptr() for t in moved if t is not None],
            kv_data_lens=[9 * 16] * 4, kv_item_lens=[16] * 4,
            state_types=[], state_data_ptrs=[], state_data_lens=[], state_item_lens=[],
            aux_data_ptrs=[t.data_ptr() for t in aux if t is not None],
            aux_data_lens=[4 * n for n in AUX], aux_item_lens=list(AUX))
        layout = _layout()
        check_kvargs(args, layout)
        got = buffers_from_kvargs(args, layout)
        try:
            assert [len(c) for c in got.components] == [4, 2]
            assert [r.offset for r in got.components[0]] == [0, 0, 9 * 16, 9 * 16]
        finally:
            for fd in got.fds:
                os.close(fd)
    finally:
        shared.close()


def test_anonymous_or_gpu_memory_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"test\.kv: kvbeam shares CPU memory only"):
        share_tensors([torch.zeros(4, device="meta")], "test.kv", SharedMemory())


def test_prefill_inflight_polls_never_say_bootstrapping() -> None:
    # sglang 0.5.23's prefill inflight queue raises on Bootstrapping (1).
    assert [prefill_poll(s) for s in range(5)] == [0, 3, 2, 3, 4]


def test_the_metadata_row_is_the_aux_index() -> None:
    assert aux_lists(_layout(), 3) == {"REQ_SLOT": [3]}
    with pytest.raises(ValueError, match="moves the metadata row, but sglang gave aux_index"):
        aux_lists(_layout(), None)


class _Manager(ManagerMembers):
    def __init__(self, port: int, token: str = "") -> None:
        self.server_args = SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=port)
        self.daemon = "127.0.0.1:50051"
        self.security = Security(token=token) if token else Security()
        self._init_scheduler_members()


def test_prefill_registers_itself_and_decode_finds_it() -> None:
    server = bootstrap.BootstrapServer("127.0.0.1", 0)
    try:
        port = int(server.address.rpartition(":")[2])
        decode = _Manager(port)
        assert decode.try_ensure_parallel_info(server.address) is False  # not registered yet
        assert decode.prefill_info_table == {}
        _Manager(port).register_to_bootstrap()
        assert bootstrap.call(server.address, "get", PREFILL_KEY) == {"daemon": "127.0.0.1:50051"}
        assert decode.try_ensure_parallel_info(server.address) is True
        info = decode.prefill_info_table[server.address]
        assert info == PrefillInfo("127.0.0.1:50051") and info.dp_size == 1
    finally:
        server.close()


def test_registration_and_lookup_present_the_token_a_guarded_store_requires() -> None:
    server = bootstrap.BootstrapServer("127.0.0.1", 0, token="s3cret")
    try:
        port = int(server.address.rpartition(":")[2])
        with pytest.raises(AuthenticationError):
            _Manager(port).register_to_bootstrap()  # no token: refused, never retried
        _Manager(port, token="s3cret").register_to_bootstrap()
        decode = _Manager(port, token="s3cret")
        assert decode.try_ensure_parallel_info(server.address) is True
        assert decode.prefill_info_table[server.address] == PrefillInfo("127.0.0.1:50051")
    finally:
        server.close()


def test_decode_retries_an_unreachable_prefill_bootstrap() -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    assert _Manager(1).try_ensure_parallel_info(addr) is False


class _RacingDaemon:
    """Decode's daemon as a poll may see it: unknown, then (prefill reserved, moved and
    cleared its room in between) Success."""

    def __init__(self) -> None:
        self.calls = 0
        self.known = True  # False: the daemon never learns of the request

    def status(self, request_id: str) -> object:
        from kvbeam.errors import UnknownRequest
        from kvbeam.states import TransferState

        self.calls += 1
        if self.calls == 1 or not self.known:
            raise UnknownRequest(f"unknown request {request_id}")
        return SimpleNamespace(state=TransferState.SUCCESS)


def test_a_room_cleared_between_two_decode_calls_is_not_an_abort(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen in the served test on a loaded host: decode's Status said unknown, then
    # prefill reserved, moved, succeeded and deleted the room before decode read it.
    from kvbeam.integrations.sglang.conn import KvbeamKVReceiver

    server = bootstrap.BootstrapServer("127.0.0.1", 0)
    try:
        daemon = _RacingDaemon()
        mgr = SimpleNamespace(
            daemon="racing:1", layout=_layout(), client=lambda address: daemon,
            store=lambda address, op, key, value=None: bootstrap.call(address, op, key, value))
        rx = KvbeamKVReceiver(mgr, server.address, 7)  # type: ignore[arg-type]
        rx.prefill, rx.metadata_sent = {"daemon": "p:1"}, True  # init and send_metadata done
        assert rx.poll() == 4  # Success, not "prefill aborted room 7 before reserving"
        assert daemon.calls == 2
        daemon.known = False  # and when the daemon does not know it either: Failed, said so
        assert rx.poll() == 0
        with pytest.raises(RuntimeError, match="prefill aborted room 7 before reserving"):
            rx.failure_exception()
    finally:
        server.close()


def test_docs_show_the_flags_and_side_config_the_served_test_runs() -> None:
    import re
    from pathlib import Path

    import yaml

    from tests.sglang_server_helpers import MAX_RUNNING, SGLANG_FLAGS, side_config

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    flags = re.search(r"`SERVER_FLAGS` are the CPU setup of the test \(tests/"
                      r"sglang_server_helpers.py\):\n(.*?)\. What needs what", doc, re.S)
    assert flags is not None
    assert " ".join(flags.group(1).replace("\n", " ").strip("`").split("` `")).replace(
        "`", "") == " ".join(SGLANG_FLAGS)
    block = re.search(r"The test's, for the tiny Llama:\n\n```yaml\n(.*?)```", doc, re.S)
    assert block is not None
    from kvbeam.pools.spec import SideConfig

    assert SideConfig.from_mapping(yaml.safe_load(block.group(1)), "doc") == \
        SideConfig.from_mapping(side_config(aux_rows=2 * MAX_RUNNING), "doc")
