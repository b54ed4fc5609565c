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
    decode_poll,
    decode_seq_len,
    prefill_poll,
    same_lists,
)
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.sglang_mha import sglang_mha_spec
from kvbeam.pools.shm import shared_file_size
from kvbeam.pools.spec import PoolSpec, SideConfig

AUX = (64, 128)


def _layout(rows: int = 9, aux_rows: int = 4):  # type: ignore[no-untyped-def]
    return build_side_layout(SideConfig(model="m", target=sglang_mha_spec(
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


def test_decode_polls_say_waiting_until_prefill_writes() -> None:
    # decode's reservation is Bootstrapping at its daemon until prefill's first write;
    # sglang's decode transfer queue reads WaitingForInput then, as its own backends say.
    assert [decode_poll(s) for s in range(5)] == [0, 2, 2, 3, 4]


def _lists_of(layout: SideLayout, spec: PoolSpec, seq_len: int) -> dict[str, object]:
    used = {b.index_kind for c in layout.components for b in c.buffers}
    return {k.name: v for k, v in request_indices(spec, 0, seq_len).items() if k in used}


def test_decode_derives_the_request_length_from_its_lists() -> None:
    from kvbeam.refengine.configs import tiny_config

    mha = SideConfig(model="m", target=sglang_mha_spec(
        num_layers=2, page_size=1, num_kv_heads=2, head_dim=4, dtype="float16",
        token_rows=300, aux_item_lens=AUX, aux_rows=4))
    layout = build_side_layout(mha)
    for n in (1, 7, 250):  # page_size 1: the page count is the length
        assert decode_seq_len(mha.target, _lists_of(layout, mha.target, n)) == n
    for unified in (True, False):  # page_size 128: one length of the page, same lists
        config = tiny_config(unified=unified, draft=True)
        layout = build_side_layout(config)
        for n in (20, 100, 250):
            got = decode_seq_len(config.target, _lists_of(layout, config.target, n))
            assert -(-got // 128) == -(-n // 128)
            assert same_lists(config.target, layout, n, got), (unified, n, got)
    ring = tiny_config(unified=True, draft=True)
    assert decode_seq_len(ring.target, _lists_of(build_side_layout(ring),
                                                 ring.target, 20)) == 20  # rows pin it


def test_decode_lists_that_fit_no_length_are_refused_naming_them() -> None:
    from kvbeam.refengine.configs import tiny_config

    config = tiny_config(unified=True, draft=True)
    lists = _lists_of(build_side_layout(config), config.target, 20)
    lists["KV_PAGES"] = [0, 1]  # two pages, but ring rows of a 20-token request
    with pytest.raises(ValueError, match=r"fit no request of 129\.\.256 tokens"):
        decode_seq_len(config.target, lists)
    with pytest.raises(ValueError, match="no KV pages"):
        decode_seq_len(config.target, {"KV_PAGES": []})


def test_docs_show_the_flags_and_side_config_the_served_test_runs() -> None:
    import re
    from pathlib import Path

    import yaml

    from kvbeam.pools.spec import SideConfig
    from tests.docs_blocks import script
    from tests.sglang_server_helpers import MAX_RUNNING, SGLANG_FLAGS, side_config

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    commands = script("docs/sglang.md")  # what tests/host/test_docs_run.py runs
    flags = re.search(r'^CPU="(.*?)"$', commands, re.S | re.M)
    assert flags is not None
    assert flags.group(1).split() == list(SGLANG_FLAGS)
    want = SideConfig.from_mapping(side_config(aux_rows=2 * MAX_RUNNING), "doc")
    # No file describes the pools: the backend reads them from sglang.
    assert "--config" not in commands and "KVBEAM_CONFIG" not in commands
    block = re.search(r"The test's, for the tiny Llama:\n\n```yaml\n(.*?)```", doc, re.S)
    assert block is not None
    assert SideConfig.from_mapping(yaml.safe_load(block.group(1)), "doc") == want
