"""The attach wire (proto/attach_codec.py) and the daemon's checks of a description
(server/engines/memory.py), in process: memfds, a socketpair, no daemon."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
import subprocess
import sys

import pytest

from kvbeam.engine import EngineBuffers, EnginePools, attach
from kvbeam.errors import AttachError
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.shm import unmap
from kvbeam.proto.attach_codec import (
    ATTACH_VERSION,
    MAX_ERROR_CHARS,
    MAX_MESSAGE_BYTES,
    AttachReply,
    AttachRequest,
    BufferRef,
    MessageReader,
    config_differences,
    config_to_mapping,
    decode_body,
    first_config_difference,
    frame,
    read_message,
    reply_to_json,
    request_from_json,
    request_to_json,
)
from kvbeam.server.engines.memory import map_engine_memory
from tests.fixtures import UNIFIED_DRAFT, side


def _request(pools: EnginePools, buffers: EngineBuffers | None = None,
             **changes: object) -> AttachRequest:
    b = buffers or pools.buffers()
    req = AttachRequest("attach", "host_shm", pools.config,
                        tuple(tuple(c) for c in b.components))
    return dataclasses.replace(req, **changes)  # type: ignore[arg-type]


def _roundtrip(req: AttachRequest, nfds: int) -> AttachRequest:
    return request_from_json(request_to_json(req), nfds)


def test_request_round_trips_with_config_and_components() -> None:
    with EnginePools(side()) as pools:
        req = _request(pools)
        back = _roundtrip(req, len(pools.fds))
    assert back == dataclasses.replace(req, config=back.config)
    assert back.config is not None
    assert first_config_difference(side(), back.config) is None
    assert len(back.components) == len(build_side_layout(side()).components)


@pytest.mark.parametrize(("change", "field", "text"), [
    ({"version": 1}, "version", "attach protocol version 1 is not supported"),
    ({"op": "grab"}, "op", "unknown op 'grab'"),
    ({"memory_kind": "vram"}, "memory_kind", "unknown memory kind 'vram'"),
    ({"config": {"model": "m"}}, "config", "target: required field is missing"),
    ({"components": {}}, "components", "must be a list"),
    ({"pushes": "some"}, "pushes", "unknown push mode 'some'"),
    ({"pushes": None}, "pushes", "unknown push mode None"),
])
def test_malformed_requests_are_refused_naming_the_field(change: dict[str, object], field: str,
                                                         text: str) -> None:
    data = {**request_to_json(AttachRequest("attach", config=side(), components=())), **change}
    with pytest.raises(AttachError, match=text) as info:
        request_from_json(data, 1)
    assert info.value.field == field


def test_the_push_mode_round_trips_and_defaults_to_every_change() -> None:
    """``pushes`` travels with the attach; an engine that does not say (an older one)
    is pushed every change, as before the field."""
    with EnginePools(side()) as pools:
        assert _roundtrip(_request(pools, pushes="final"), len(pools.fds)).pushes == "final"
        data = request_to_json(_request(pools))
        assert data["pushes"] == "all"
        del data["pushes"]
        assert request_from_json(data, len(pools.fds)).pushes == "all"


def test_an_unknown_push_mode_is_refused_before_connecting() -> None:
    with EnginePools(side()) as pools, pytest.raises(AttachError,
                                                     match="unknown push mode") as info:
        attach("/nonexistent/kvbeam.sock", pools, pushes="changes")
    assert info.value.field == "pushes"


def test_buffer_fields_are_checked() -> None:
    data = request_to_json(AttachRequest("attach", config=side(), components=(
        (BufferRef(0, 0, 16, 8),), (BufferRef(3, 0, 16, 8),))))
    with pytest.raises(AttachError, match=r"components\[1\]\[0\].fd_index: 3 but only 2"):
        request_from_json(data, 2)
    data["components"][0][0]["offset"] = -1
    with pytest.raises(AttachError, match=r"components\[0\]\[0\].offset: must be an integer"):
        request_from_json(data, 4)


def test_detach_needs_no_config() -> None:
    assert request_from_json({"version": ATTACH_VERSION, "op": "detach"}, 0).op == "detach"


def test_first_config_difference_names_the_field() -> None:
    a = side()
    assert first_config_difference(a, a) is None
    assert first_config_difference(a, side(head_dim=32)) == "target.head_dim: daemon=16, engine=32"
    assert first_config_difference(a, dataclasses.replace(a, draft=None)) == (
        "draft: daemon=present, engine=absent")
    assert config_to_mapping(a)["target"]["compression_ratios"] == [0, 4, 0, 4]
    # All of them, for the daemon's --config refusal: not the first only.
    assert config_differences(a, side(head_dim=32, dtype="float16")) == [
        "target.head_dim: daemon=16, engine=32",
        "target.dtype: daemon='bfloat16', engine='float16'"]


def test_message_and_fds_cross_a_socket() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b, EnginePools(side()) as pools:
        msg = frame(request_to_json(_request(pools)))
        sent = socket.send_fds(a, [msg], pools.fds)
        a.sendall(msg[sent:])
        data, fds = read_message(b, with_fds=True)
        try:
            assert len(fds) == len(pools.fds)
            config = request_from_json(data, len(fds)).config
            assert config is not None
            assert first_config_difference(side(), config) is None
        finally:
            for fd in fds:
                os.close(fd)
        a.close()
        with pytest.raises(EOFError):
            read_message(b)


# ---- the daemon's checks (map_engine_memory) ------------------------------------------
def _attach(pools: EnginePools, req: AttachRequest, role: str = "decode",
            expected: object = None) -> None:
    fds = [os.dup(fd) for fd in pools.fds]
    memory = map_engine_memory(req, fds, role, expected)  # type: ignore[arg-type]
    unmap(memory.side.take_maps())


def _with(pools: EnginePools, i: int, j: int, **changes: int) -> AttachRequest:
    b = pools.buffers()
    b.components[i][j] = dataclasses.replace(b.components[i][j], **changes)
    return _request(pools, b)


@pytest.mark.parametrize(("make", "field", "text"), [
    (lambda p: _with(p, 0, 1, length=1), "components[0][1].length",
     r"components\[0\]\[1\].length \(target.layer3.c4_kv\): engine=1, layout="),
    (lambda p: _with(p, 0, 0, item_len=7), "components[0][0].item_len", "engine=7, layout="),
    (lambda p: _with(p, 1, 0, offset=1 << 30), "components[1][0].offset",
     "is past the end of fd"),
    (lambda p: _request(p, memory_kind="dmabuf"), "memory_kind",
     "memory_kind dmabuf: this daemon takes host memory only here"),
    (lambda p: _request(p, components=_request(p).components[:-1]), "components",
     "components: 3 given, the config's layout has 4 \\(kv, target.swa, "),
])
def test_bad_descriptions_are_refused_before_anything_is_mapped(make: object, field: str,
                                                                text: str) -> None:
    with EnginePools(side()) as pools, pytest.raises(AttachError, match=text) as info:
        _attach(pools, make(pools))  # type: ignore[operator]
    assert info.value.field == field


def test_overlapping_buffers_are_refused() -> None:
    with EnginePools(side()) as pools:
        b = pools.buffers()
        first = b.components[0][0]
        b.components[0][1] = BufferRef(first.fd_index, first.offset,
                                       b.components[0][1].length, b.components[0][1].item_len)
        b.components[0][1] = dataclasses.replace(b.components[0][1], fd_index=first.fd_index)
        with pytest.raises(AttachError, match=r"overlaps|past the end"):
            _attach(pools, _request(pools, b))


def test_config_must_equal_the_daemons_config() -> None:
    with EnginePools(side(head_dim=32)) as pools, \
            pytest.raises(AttachError, match=r"target\.head_dim: daemon=16, engine=32"):
        _attach(pools, _request(pools), expected=side())


def test_seed_checks_refuse_a_bad_draft_with_sglangs_wording() -> None:
    bad = dataclasses.replace(side(), draft=dataclasses.replace(UNIFIED_DRAFT, unified_kv=False))
    with EnginePools(bad) as pools, pytest.raises(
            AttachError, match="DSV4 target and draft pools must use the same unified-KV mode"
    ) as info:
        _attach(pools, _request(pools), role="prefill")
    assert info.value.field == "config.draft"
    assert "(prefill side)" in str(info.value)


def test_a_mapped_side_shares_the_engines_pages() -> None:
    with EnginePools(side()) as pools:
        pools.fill_pattern(5)
        fds = [os.dup(fd) for fd in pools.fds]
        memory = map_engine_memory(_request(pools), fds, "decode", side())
        buf = memory.layout.flat_buffers[3]
        view = memory.side.buffer_array(buf)
        assert bytes(view[:64]) == bytes(pools.buffer_array(buf)[:64])
        view[:8] = 7  # a remote write landing in the daemon's mapping...
        assert list(pools.buffer_array(buf)[:8]) == [7] * 8  # ...is in the engine's memory
        assert len(memory.side.tensor_regions()) == len(pools.fds)
        del view
        assert unmap(memory.side.take_maps()) == 0


def test_engine_package_imports_neither_torch_nor_grpc() -> None:
    code = ("import sys, kvbeam.engine; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---- bounded refusals (issue 45, item 8) ------------------------------------------------
def test_a_refusal_quoting_a_huge_value_stays_small_and_says_it_was_cut() -> None:
    """A refusal quotes what it refuses with depth and length bounded, and a reply's error
    is cut at MAX_ERROR_CHARS whatever produced it (a 4 MiB config used to come back as a
    4 MiB refusal, larger than a message may be, and got no answer at all)."""
    data = {**request_to_json(AttachRequest("attach", config=side(), components=())),
            "config": ["x" * 100] * 40_000}
    with pytest.raises(AttachError) as info:
        request_from_json(data, 0)
    assert info.value.field == "config" and len(str(info.value)) < 300, str(info.value)
    reply = reply_to_json(AttachReply(False, "e" * (MAX_ERROR_CHARS * 3), "f" * 1000))
    assert len(reply["error"]) < MAX_ERROR_CHARS + 60
    assert reply["error"].endswith(f"... ({MAX_ERROR_CHARS * 2} more characters cut)")
    assert len(reply["field"]) < 260
    assert len(frame(reply)) < 3000


@pytest.mark.parametrize("body", [
    b"[" * 200_000 + b"]" * 200_000,  # nested past the decoder's depth
    b'{"version": 1, "op": "\xff\xfe"}',  # not UTF-8
    b"",  # nothing
])
def test_unreadable_bodies_are_one_attach_error(body: bytes) -> None:
    with pytest.raises(AttachError, match="attach message is not JSON") as info:
        decode_body(body)
    assert len(str(info.value)) < 300


def test_a_deep_config_is_refused_naming_it() -> None:
    deep: object = 1
    for _ in range(900):  # within the decoder's depth, past what the checks recurse into
        deep = [deep]
    data = {**request_to_json(AttachRequest("attach", config=side(), components=()))}
    data["config"] = {**data["config"], "target": {**data["config"]["target"],
                                                     "head_dim": deep}}
    body = json.dumps(data).encode()
    with pytest.raises(AttachError) as info:
        request_from_json(decode_body(body), 0)
    assert info.value.field == "config" and len(str(info.value)) < 700, str(info.value)


def test_a_message_read_in_pieces_stops_at_its_end_and_refuses_an_oversize_length() -> None:
    msg = frame({"version": 1, "op": "detach"})
    reader = MessageReader()
    got = None
    pieces = 0
    while got is None:
        want = reader.wanted(3)
        assert 0 < want <= 4
        got = reader.feed(msg[:want])
        msg = msg[want:]
        pieces += 1
    assert json.loads(got) == {"version": 1, "op": "detach"} and pieces > 3
    with pytest.raises(AttachError, match="exceeds"):
        MessageReader().feed(struct.pack("<I", MAX_MESSAGE_BYTES + 1))
