"""Staged engines through two real daemons over TCP: KV in ordinary CPU tensors, moved
through staging buffers (the GPU path's code on CPU tensors that are not the attached memory).

Each reference engine computes in its own KV (``AllocatedSide``, private memory the
daemons never see) and attaches a staging buffer (memfds) sized for two requests;
prefill gathers the request into its buffer, the daemons move staging to staging
(integrity on), decode scatters into its KV after Success. The continuation must equal
the colocated run's. Negative controls: decode's daemon flips one landed (staged) byte,
and the request fails integrity without decode scattering or decoding; a transfer that
lands but skips the scatter continues differently (the scatter is what decode uses).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvbeam.errors import TransferFailed
from kvbeam.pools.plan import IndexLists
from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.run import SplitRun, compare, make_prompt, torch_threads
from kvbeam.refengine.served import ServedPair, Staging
from kvbeam.server.faults import CORRUPT_LANDED_ENV, ENABLE_FLAG
from tests.refengine_helpers import check_served

K = 8


@pytest.mark.parametrize("unified", [True, False], ids=["unified-draft", "paged-draft"])
def test_staged_continuation_over_daemons_is_token_identical(unified: bool) -> None:
    config = tiny_config(unified=unified, draft=True)
    with ServedPair(config, staging=Staging("cpu", requests=2)) as pair:
        out, inn = pair.staging_buffers
        # The daemons were given the staging buffers' config: two requests' room.
        assert pair.prefill_pools.config.target.num_req_slots == 2
        assert pair.prefill_side is not pair.prefill_pools
        with torch_threads(1):
            for n in (250, 256):
                t0 = time.monotonic()
                c = compare(config, make_prompt(n, 512, seed=n), K, transfer=pair.transfer,
                            prefill_side=pair.prefill_side, decode_side=pair.decode_side)
                check_served(f"staged cpu {'unified' if unified else 'paged'}", c,
                             pair.records[-1], draft=True, seconds=time.monotonic() - t0)
        m_out, m_in = out.metrics, inn.metrics
    print(f"staging: out {m_out}; in {m_in}")
    assert m_out.requests_out == m_in.requests_in == 2
    assert m_out.bytes_out == m_in.bytes_in == sum(r.bytes for r in pair.records)
    assert m_out.held == m_in.held == 0  # every request's items back


@pytest.fixture(scope="module")
def corrupting_pair() -> Iterator[ServedPair]:
    """A staged pair whose decode daemon flips one landed byte of every request."""
    with ServedPair(tiny_config(unified=True, draft=True), extra=(ENABLE_FLAG,),
                    decode_env={CORRUPT_LANDED_ENV: "1"},
                    staging=Staging("cpu", requests=1)) as pair:
        yield pair


def test_a_flipped_staged_byte_is_caught_before_the_scatter(corrupting_pair: ServedPair
                                                            ) -> None:
    pair = corrupting_pair
    _, inn = pair.staging_buffers
    decoded: list[int] = []
    with torch_threads(1):
        split = SplitRun(pair.config, make_prompt(250, 512), prefill_side=pair.prefill_side)
        with pytest.raises(TransferFailed) as info:
            decoded.append(len(split.decode(K, transfer=pair.transfer,
                                            decode_side=pair.decode_side).tokens))
    assert not decoded  # the engine never decoded from the corrupted state
    assert info.value.reason == "integrity", str(info.value)
    m = inn.metrics
    assert m.requests_in == 0 and m.held == 0  # no scatter; the landing's items released


def test_landing_without_the_scatter_continues_differently() -> None:
    """The negative control of the staged comparison: the bytes land in decode's staging
    buffer, but the engine decodes from its own KV without scattering them."""
    config = tiny_config(unified=True, draft=True)
    with ServedPair(config, staging=Staging("cpu", requests=1)) as pair:
        out, inn = pair.staging_buffers

        def land_only(src: IndexLists, dst: IndexLists, seq_len: int) -> None:
            staged = out.stage_out(pair.prefill_side, src)
            landing = inn.reserve(dst)
            try:
                pair._transfer(staged.lists, landing.lists, seq_len)
            finally:
                out.release(staged)
                inn.release(landing)

        with torch_threads(1):
            c = compare(config, make_prompt(250, 512, seed=250), K, transfer=land_only,
                        prefill_side=pair.prefill_side, decode_side=pair.decode_side)
    assert pair.records[-1].ok  # the transfer itself succeeded
    assert not c.tokens_equal, c.table()
