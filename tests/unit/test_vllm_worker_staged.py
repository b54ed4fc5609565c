"""The vLLM connector's worker side staged, without vLLM or a daemon.

vLLM's KV cache here is ordinary CPU tensors in vLLM's layout (one ``[blocks, heads,
tokens, K and V]`` tensor per layer, not moved into shared memory); the worker stages
it through a real :class:`~kvbeam.engine.staging.StagingBuffer` (memfds) whose CPU
copies are the same code a GPU's take. The test plays the daemon on the other end of
the engine channel, as tests/unit/test_vllm_worker_channel.py does: it reads the
frames, writes the landed bytes into decode's staging items as the daemons would, and
pushes states.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

from kvbeam.engine.channel import EngineChannel
from kvbeam.engine.staging import StagingBuffer, TensorKV, dense_bytes
from kvbeam.errors import ConfigError
from kvbeam.integrations.vllm import params as P
from kvbeam.integrations.vllm import scheduler as S
from kvbeam.integrations.vllm.staged import STAGING_OCCUPANCY, StagingReport, stages
from kvbeam.integrations.vllm.worker import WorkerSide
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.pools.types import IndexKind
from kvbeam.proto import engine_frames as ef
from kvbeam.states import FailureReason, TransferState
from tests.fake_clock import FakeClock
from tests.unit.test_vllm_worker_channel import _Attachment, _frames

KV = IndexKind.KV_PAGES
BLOCK, HEADS, HEAD = 32, 2, 32
LAYERS, BLOCKS = 2, 16
SETTINGS = P.Settings(daemons=("127.0.0.1:7",), attach_sockets=("/x.sock",), model="m",
                      staging=P.Staging(enabled=True, requests=2, tokens=4 * BLOCK, wait_s=0.3))


def _cache(seed: int) -> dict[str, torch.Tensor]:
    """vLLM CPU's layer caches: [blocks, KV heads, tokens, K and V], float32."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g)
            for i in range(LAYERS)}


class Staged:
    """A staged worker over ``cache``, its engine channel's daemon end."""

    def __init__(self, cache: dict[str, torch.Tensor], settings: P.Settings = SETTINGS,
                 tp: tuple[int, int] = (0, 1), heads: int = HEADS) -> None:
        self.cache = cache
        self.worker = WorkerSide(settings, block_size=BLOCK, num_kv_heads=heads, head_size=HEAD,
                                 tp_rank=tp[0], tp_size=tp[1])
        views = list(cache.values())
        spec = paged_spec(num_layers=LAYERS, block_size=BLOCK, num_kv_heads=heads,
                          head_size=HEAD, dtype="float32", inner_layout="LBHNC",
                          num_blocks=BLOCKS, tp_rank=tp[0], tp_size=tp[1])
        self.worker._stage(paged_side_config("m", spec), views, "cpu")
        self.worker._views = views
        engine, self.daemon = socket.socketpair()
        self.worker.attachment = _Attachment(  # type: ignore[assignment]
            EngineChannel(engine, "test"))

    @property
    def staging(self):  # type: ignore[no-untyped-def]
        assert self.worker.staging is not None
        return self.worker.staging

    def staged_rows(self, items: np.ndarray) -> list[torch.Tensor]:
        """The staging buffer's items ``items`` of every layer."""
        out = []
        for buf in self.staging.layout.flat_buffers:
            rows = self.staging.pools.buffer_view(buf).view(-1, buf.item_len)
            out.append(rows[torch.from_numpy(np.asarray(items, dtype=np.int64))].clone())
        return out

    def land(self, items: np.ndarray, rows: list[torch.Tensor]) -> None:
        """What the daemons do on decode: the bytes into the staging items."""
        for buf, data in zip(self.staging.layout.flat_buffers, rows, strict=True):
            view = self.staging.pools.buffer_view(buf).view(-1, buf.item_len)
            view[torch.from_numpy(np.asarray(items, dtype=np.int64))] = data

    def push(self, request_id: str, state: TransferState,
             reason: FailureReason | None = None) -> None:
        self.daemon.sendall(ef.encode(ef.State(request_id, state, reason, 3, "x")))

    def finished(self, want: tuple[set[str], set[str]], timeout: float = 5.0
                 ) -> tuple[set[str], set[str]]:
        sent: set[str] = set()
        received: set[str] = set()
        deadline = time.monotonic() + timeout
        while (sent, received) != want and time.monotonic() < deadline:
            s, r = self.worker.get_finished()
            sent |= s
            received |= r
            time.sleep(0.01)
        return sent, received

    def close(self) -> None:
        self.worker.close()
        self.daemon.close()


@pytest.fixture
def prefill() -> Iterator[Staged]:
    side = Staged(_cache(1))
    yield side
    side.close()


@pytest.fixture
def decode() -> Iterator[Staged]:
    side = Staged(_cache(2))
    yield side
    side.close()


@pytest.fixture
def timed_decode(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Staged, FakeClock]]:
    """A decode side whose staging waits run on a fake clock that the test moves."""
    clock = FakeClock()
    monkeypatch.setattr("kvbeam.integrations.vllm.worker.StagingBuffer",
                        partial(StagingBuffer, clock=clock))
    side = Staged(_cache(2))
    yield side, clock
    side.close()


def _block_bytes(cache: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [v[block].reshape(-1).view(torch.uint8).clone() for v in cache.values()]


def test_prefill_gathers_the_blocks_and_sends_the_staging_items(prefill: Staged) -> None:
    prefill.worker.absorb(S.StepPlan(sends=[S.Push("a", "t1", (5, 9, 2), ("d:1",), 70)]))
    (send,) = _frames(prefill.daemon, 1)
    assert isinstance(send, ef.Send) and send.request_id == "t1"
    items = (send.indices or {})[KV]
    assert len(items) == 3 and not np.array_equal(items, [5, 9, 2])  # staging items
    staged = prefill.staged_rows(items)
    for i, block in enumerate((5, 9, 2)):
        for layer, want in enumerate(_block_bytes(prefill.cache, block)):
            assert torch.equal(staged[layer][i], want), (block, layer)
    assert prefill.staging.metrics.held == 1
    prefill.push("t1", TransferState.SUCCESS)
    assert prefill.finished(({"a"}, set())) == ({"a"}, set())
    m = prefill.staging.metrics
    assert (m.held, m.requests_out, m.bytes_out) == (0, 1, 3 * LAYERS * 4 * BLOCK * HEADS * 2
                                                     * HEAD)


def test_decode_scatters_the_landed_items_into_its_blocks_after_success(decode: Staged,
                                                                        ) -> None:
    before = {b: _block_bytes(decode.cache, b) for b in (7, 3)}
    decode.worker.absorb(S.StepPlan(loads=[S.Load("b", "t2", (7, 3), ("p:1",), 45)]))
    (reserve,) = _frames(decode.daemon, 1)
    assert isinstance(reserve, ef.Reserve) and reserve.request_id == "t2"
    items = reserve.indices[KV]
    assert not np.array_equal(items, [7, 3])
    rng = np.random.default_rng(0)
    landed = [torch.from_numpy(rng.integers(0, 256, (2, buf.item_len), dtype=np.uint8))
              for buf in decode.staging.layout.flat_buffers]
    decode.land(items, landed)
    assert decode.worker.get_finished() == (set(), set())  # not Success yet: not scattered
    for b in (7, 3):  # negative control: nothing reached vLLM's blocks before Success
        assert all(torch.equal(x, y) for x, y in zip(before[b], _block_bytes(decode.cache, b),
                                                     strict=True))
    decode.push("t2", TransferState.SUCCESS)
    assert decode.finished((set(), {"b"})) == (set(), {"b"})
    for i, b in enumerate((7, 3)):
        for layer, got in enumerate(_block_bytes(decode.cache, b)):
            assert torch.equal(got, landed[layer][i]), (b, layer)
    (release,) = _frames(decode.daemon, 1)
    assert isinstance(release, ef.Release) and release.request_id == "t2"
    assert decode.staging.metrics.held == 0 and decode.staging.metrics.requests_in == 1


def test_a_failed_load_scatters_nothing_and_gives_its_items_back(decode: Staged) -> None:
    before = _block_bytes(decode.cache, 7)
    decode.worker.absorb(S.StepPlan(loads=[S.Load("b", "t2", (7,), ("p:1",), 20)]))
    (reserve,) = _frames(decode.daemon, 1)
    decode.land(reserve.indices[KV], [torch.zeros(1, buf.item_len, dtype=torch.uint8)
                                      for buf in decode.staging.layout.flat_buffers])
    decode.push("t2", TransferState.FAILED, FailureReason.INTEGRITY)
    assert decode.finished((set(), {"b"})) == (set(), {"b"})
    assert decode.worker.take_load_errors() == {7}
    assert all(torch.equal(x, y) for x, y in zip(before, _block_bytes(decode.cache, 7),
                                                 strict=True))
    assert decode.staging.metrics.held == 0
    assert decode.worker.take_counts()["load_failed_integrity"] == 1


def test_a_full_buffer_makes_a_load_wait_then_reserve_when_room_comes(decode: Staged) -> None:
    """Room for 8 blocks (2 requests x 4): a 6-block load holds most; the next 4-block
    load waits (no frame, not finished) until the first ended, then reserves."""
    decode.worker.absorb(S.StepPlan(loads=[S.Load("b", "t2", tuple(range(6)), ("p:1",), 180),
                                           S.Load("c", "t3", (8, 9, 10, 11), ("p:1",), 120)]))
    (first,) = _frames(decode.daemon, 1)
    assert first.request_id == "t2"
    assert decode.worker.get_finished() == (set(), set())
    assert decode.staging.metrics.waiting == 1
    decode.push("t2", TransferState.SUCCESS)
    assert decode.finished((set(), {"b"})) == (set(), {"b"})
    release, second = _frames(decode.daemon, 2)  # the next step reserved the waiting one
    assert isinstance(release, ef.Release) and isinstance(second, ef.Reserve)
    assert second.request_id == "t3"
    decode.push("t3", TransferState.FAILED, FailureReason.TIMEOUT)
    assert decode.finished((set(), {"c"})) == (set(), {"c"})
    assert decode.staging.metrics.held == 0 and decode.staging.metrics.waits == 1


def test_a_load_whose_wait_runs_out_is_a_load_error_declined_to_prefill(
        timed_decode: tuple[Staged, FakeClock]) -> None:
    """The wait (0.3 s here, on the staging buffer's clock) runs out while the buffer
    stays full: the load fails as a load error, prefill is told at once (DECLINE: it
    frees its blocks); a load larger than the whole buffer is refused at once the same
    way. Never a hang."""
    decode, clock = timed_decode
    decode.worker.absorb(S.StepPlan(loads=[
        S.Load("b", "t2", tuple(range(8)), ("p:1",), 250),
        S.Load("c", "t3", (8, 9), ("p:1",), 60),
        S.Load("d", "t4", tuple(range(9)), ("p:1",), 280)]))
    frames = _frames(decode.daemon, 2)
    assert [type(f) for f in frames] == [ef.Reserve, ef.Decline]  # t4 never fits
    assert frames[1].request_id == "t4" and "holds 8 in all" in frames[1].detail
    assert decode.finished((set(), {"d"})) == (set(), {"d"})  # refused at once
    clock.advance(0.29)  # t3 waits for room until 0.3 s have passed, not before
    assert decode.worker.get_finished() == (set(), set())
    assert decode.staging.metrics.waiting == 1
    clock.advance(0.02)
    assert decode.finished((set(), {"c"})) == (set(), {"c"})
    (decline,) = _frames(decode.daemon, 1)
    assert isinstance(decline, ef.Decline) and decline.request_id == "t3"
    assert "staging buffer full: waited 0.3 s" in decline.detail
    assert decode.worker.take_load_errors() == {8, 9, *range(9)}
    counts = decode.worker.take_counts()
    assert counts["load_failed_staging_full"] == 2 and counts["staging_refusals"] == 2
    decode.push("t2", TransferState.SUCCESS)
    assert decode.finished((set(), {"b"})) == (set(), {"b"})
    assert decode.staging.metrics.held == 0 and decode.staging.metrics.waiting == 0


def test_a_send_whose_wait_runs_out_is_not_sent(prefill: Staged) -> None:
    prefill.worker.absorb(S.StepPlan(sends=[S.Push("a", "t1", tuple(range(8)), ("d:1",), 250),
                                            S.Push("b", "t2", (9,), ("d:1",), 20)]))
    (send,) = _frames(prefill.daemon, 1)
    assert send.request_id == "t1"
    assert prefill.finished(({"b"}, set())) == ({"b"}, set())  # after its wait: no send
    assert prefill.worker.take_counts()["send_failed_staging_full"] == 1
    prefill.push("t1", TransferState.SUCCESS)
    assert prefill.finished(({"a"}, set())) == ({"a"}, set())
    assert prefill.staging.metrics.held == 0


def test_a_tp1_prefill_stages_once_for_both_decode_ranks(prefill: Staged) -> None:
    """Both transfers (one per decode rank) send the same staging items; they go back
    only once both ended."""
    prefill.worker.absorb(S.StepPlan(sends=[S.Push("a", "t1", (5, 9), ("d:1", "d:2"), 40)]))
    sends = _frames(prefill.daemon, 2)
    assert [s.request_id for s in sends] == ["t1.r0", "t1.r1"]
    assert np.array_equal(sends[0].indices[KV], sends[1].indices[KV])
    prefill.push("t1.r0", TransferState.SUCCESS)
    time.sleep(0.2)
    assert prefill.worker.get_finished() == (set(), set())
    assert prefill.staging.metrics.held == 1
    prefill.push("t1.r1", TransferState.FAILED, FailureReason.PEER_UNREACHABLE)
    assert prefill.finished(({"a"}, set())) == ({"a"}, set())
    assert prefill.staging.metrics.held == 0 and prefill.staging.metrics.requests_out == 1


def test_the_stats_carry_staged_bytes_copy_time_and_occupancy(prefill: Staged) -> None:
    assert prefill.worker.take_counts() == {STAGING_OCCUPANCY: 0.0}
    prefill.worker.absorb(S.StepPlan(sends=[S.Push("a", "t1", (1, 2), ("d:1",), 40)]))
    _frames(prefill.daemon, 1)
    counts = prefill.worker.take_counts()
    assert counts["staging_bytes_out"] == 2 * LAYERS * BLOCK * HEADS * 2 * HEAD * 4
    assert counts["staging_copy_out_s"] > 0 and counts[STAGING_OCCUPANCY] == 25.0
    assert prefill.worker.take_counts() == {}  # nothing new
    prefill.push("t1", TransferState.SUCCESS)
    prefill.finished(({"a"}, set()))
    assert prefill.worker.take_counts() == {STAGING_OCCUPANCY: 0.0}


def test_the_staging_decision_honours_kv_buffer_device(caplog: pytest.LogCaptureFixture,
                                                       ) -> None:
    auto, on, off = P.Staging(), P.Staging(enabled=True), P.Staging(enabled=False)
    assert not stages("cpu", auto, "cpu") and not stages("cpu", auto, "")
    assert stages("cpu", on, "cpu") and not stages("cpu", off, "cpu")
    assert stages("cuda:0", auto, "cpu") and stages("cuda:0", on, "cpu")
    with caplog.at_level(logging.INFO, "kvbeam"):
        assert stages("cuda:0", auto, "cuda")  # vLLM's default on a GPU: staged, said
    assert "pinned host staging buffer" in caplog.text
    with pytest.raises(ConfigError, match="staging: false, but vLLM's KV cache is on cuda"):
        stages("cuda", off, "cpu")
    with pytest.raises(ConfigError, match="kv_buffer_device 'xpu'"):
        stages("cuda", auto, "xpu")


def test_the_staging_settings_are_read_and_checked() -> None:
    base = {"daemon": "h:1", "attach_socket": "/s"}
    s = P.Settings.from_extra({**base, "staging": True, "staging_requests": 3,
                               "staging_tokens": 512, "staging_wait_s": 2}, "m")
    assert s.staging == P.Staging(True, 3, 512, 2.0)
    assert P.Settings.from_extra(base, "m").staging == P.Staging()
    for key, bad in (("staging", "yes"), ("staging_requests", 0), ("staging_tokens", 1.5),
                     ("staging_wait_s", -1)):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}"):
            P.Settings.from_extra({**base, key: bad}, "m")


def test_a_permuted_dense_layer_is_staged_and_a_gapped_one_refused() -> None:
    """vLLM on a GPU may order a block's dimensions otherwise (LBNHC): still one dense
    byte run per block, staged as it is; a view with gaps is refused."""
    spec = paged_spec(num_layers=1, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                      dtype="float32", inner_layout="LBNHC", num_blocks=BLOCKS)
    layout = build_side_layout(paged_side_config("m", spec))
    nhc = torch.randn(BLOCKS, BLOCK, HEADS, 2 * HEAD).transpose(1, 2)
    kv = TensorKV(layout, [nhc])
    buf = layout.flat_buffers[0]
    assert torch.equal(kv.buffer_view(buf).view(BLOCKS, -1)[3],
                       nhc[3].transpose(0, 1).reshape(-1).view(torch.uint8))
    gapped = torch.randn(BLOCKS, HEADS, BLOCK, 4 * HEAD)[..., : 2 * HEAD]
    with pytest.raises(ConfigError, match="not dense"):
        dense_bytes(gapped, buf.nbytes, "layer 0")


def test_the_staging_report_is_the_growth_since_the_last_take() -> None:
    from kvbeam.engine.staging import StagingMetrics

    report = StagingReport()
    first = report.take(StagingMetrics(bytes_out=10, copy_out_s=0.5, occupancy=0.5))
    assert first == {"staging_bytes_out": 10, "staging_copy_out_s": 0.5,
                     STAGING_OCCUPANCY: 50.0}
    assert report.take(replace(StagingMetrics(bytes_out=10, copy_out_s=0.5, occupancy=0.5),
                               waits=2)) == {"staging_waits": 2}


# ---- layer by layer, staged ---------------------------------------------------------------
def _layered(side: Staged) -> list[str]:
    """The worker's layers as register_kv_caches names them; their names."""
    names = list(side.cache)
    side.worker._layer_of = {name: i for i, name in enumerate(names)}
    return names


def test_a_staged_prompt_is_gathered_and_given_a_layer_at_a_time(prefill: Staged) -> None:
    """Staged layer by layer: the staging items are taken at the prompt's last step;
    each layer is gathered when vLLM wrote it (a later layer's bytes as they are then,
    not as they were when the stream began) and given with its frame; the last layer's
    frame is final; the items go back once the send ended after vLLM's end."""
    names = _layered(prefill)
    push = S.Push("a", "t1", (5, 9, 2), ("d:1",), 70)
    prefill.worker.absorb(S.StepPlan(streams=[push]))
    assert prefill.staging.metrics.held == 1  # its items, taken at once
    prefill.worker.save_layer(names[0])
    (first,) = _frames(prefill.daemon, 1)
    assert isinstance(first, ef.Send)
    assert (first.request_id, first.kv_offset, first.layers, first.final) == ("t1", 0, 1, False)
    items = (first.indices or {})[KV]
    assert len(items) == 3 and not np.array_equal(items, [5, 9, 2])  # staging items
    staged = prefill.staged_rows(items)
    for i, block in enumerate((5, 9, 2)):
        assert torch.equal(staged[0][i], _block_bytes(prefill.cache, block)[0])
        assert not torch.equal(staged[1][i], _block_bytes(prefill.cache, block)[1])
    prefill.cache[names[1]].add_(1.0)  # vLLM computes the last layer now
    prefill.worker.save_layer(names[1])
    (last,) = _frames(prefill.daemon, 1)
    assert (last.kv_offset, last.layers, last.final) == (3, None, True)
    assert not len((last.indices or {}).get(KV, []))  # the items went with the first
    staged = prefill.staged_rows(items)
    for i, block in enumerate((5, 9, 2)):
        for layer, want in enumerate(_block_bytes(prefill.cache, block)):
            assert torch.equal(staged[layer][i], want), (block, layer)
    m = prefill.staging.metrics
    assert (m.requests_out, m.bytes_out) == (1, 3 * LAYERS * 4 * BLOCK * HEADS * 2 * HEAD)
    assert prefill.worker.take_counts()["streamed"] == 1
    prefill.push("t1", TransferState.SUCCESS)
    time.sleep(0.2)
    assert prefill.worker.get_finished() == (set(), set()), "reported before vLLM ended it"
    prefill.worker.absorb(S.StepPlan(sends=[push]))  # vLLM's end: no second send
    assert prefill.finished(({"a"}, set())) == ({"a"}, set())
    assert prefill.staging.metrics.held == 0


@pytest.fixture
def patient() -> Iterator[Staged]:
    """A prefill whose sends wait up to 10 s for staging room."""
    side = Staged(_cache(1), replace(SETTINGS, staging=replace(SETTINGS.staging,
                                                               wait_s=10.0)))
    yield side
    side.close()


def test_a_staged_prompt_without_room_at_its_last_step_goes_whole_at_its_end(
        patient: Staged) -> None:
    """The buffer is held by another prompt's items: the second is not streamed (no
    frame per layer) and goes whole, gathered once room came, after vLLM ended it."""
    prefill = patient
    names = _layered(prefill)
    big = S.Push("a", "t1", tuple(range(8)), ("d:1",), 250)  # every staging item
    small = S.Push("b", "t2", (7,), ("d:1",), 20)
    prefill.worker.absorb(S.StepPlan(streams=[big, small]))
    for name in names:
        prefill.worker.save_layer(name)
    frames = _frames(prefill.daemon, 2)
    assert [(f.request_id, f.final) for f in frames] == [("t1", False), ("t1", True)]
    assert prefill.worker.take_counts()["streamed"] == 1
    prefill.worker.absorb(S.StepPlan(sends=[big, small]))  # both ended in vLLM
    prefill.push("t1", TransferState.SUCCESS)
    assert prefill.finished(({"a"}, set())) == ({"a"}, set())
    (whole,) = _frames(prefill.daemon, 1)  # the room came: gathered and sent whole
    assert (whole.request_id, whole.final, whole.layers) == ("t2", True, None)
    staged = prefill.staged_rows((whole.indices or {})[KV])
    for layer, want in enumerate(_block_bytes(prefill.cache, 7)):
        assert torch.equal(staged[layer][0], want)
    prefill.push("t2", TransferState.SUCCESS)
    assert prefill.finished(({"b"}, set())) == ({"b"}, set())
    assert prefill.staging.metrics.held == 0


def test_a_staged_stream_cancelled_before_its_first_layer_gives_its_items_back(
        prefill: Staged) -> None:
    names = _layered(prefill)
    prefill.worker.absorb(S.StepPlan(streams=[S.Push("a", "t1", (5,), ("d:1",), 20)]))
    assert prefill.staging.metrics.held == 1
    prefill.worker.absorb(S.StepPlan(cancels=["a"]))
    prefill.worker.save_layer(names[0])  # no longer streamed: nothing
    assert prefill.finished(({"a"}, set())) == ({"a"}, set())
    assert prefill.staging.metrics.held == 0
    prefill.daemon.settimeout(0.2)
    with pytest.raises(TimeoutError):
        prefill.daemon.recv(1)
