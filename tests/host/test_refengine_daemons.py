"""Token-identical continuation through two real daemons over TCP (``--pools engine``).

The reference engines' pools are memfds attached to a prefill and a decode daemon
(:class:`~kvbeam.refengine.served.ServedPair`); the state moves prefill engine ->
prefill daemon -> decode daemon -> decode engine, at each engine's own shuffled
indices, into decode pools filled with random bytes, integrity on. The decode
engine's continuation must equal the colocated run's: tokens, logits, draft
proposals. One daemon pair per config, several prompts through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbeam.errors import TransferFailed
from kvbeam.pools.plan import IndexLists
from kvbeam.pools.types import IndexKind
from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.run import SplitRun, compare, make_prompt, torch_threads
from kvbeam.refengine.served import ServedPair
from kvbeam.server.faults import CORRUPT_LANDED_ENV, ENABLE_FLAG
from tests.refengine_helpers import check_served

K = 8
# (unified, draft, prompt lengths): 256 ends on a page, window and C128 boundary at
# once, 250 on none, 224 on the window only, 20 is shorter than the window.
CASES = [(True, True, (256, 250)), (False, True, (250, 20)), (True, False, (224,)),
         (False, False, (256,))]


def _mode(unified: bool, draft: bool) -> str:
    return f"{'unified' if unified else 'paged'}-{'draft' if draft else 'nodraft'}"


@pytest.mark.parametrize(("unified", "draft", "lengths"), CASES,
                         ids=[_mode(u, d) for u, d, _ in CASES])
def test_continuation_over_daemons_is_token_identical(unified: bool, draft: bool,
                                                      lengths: tuple[int, ...]) -> None:
    config = tiny_config(unified=unified, draft=draft)
    seen: list[tuple[IndexLists, IndexLists]] = []
    with ServedPair(config) as pair:
        def transfer(src: IndexLists, dst: IndexLists, seq_len: int) -> None:
            seen.append((src, dst))
            pair.transfer(src, dst, seq_len)

        with torch_threads(1):
            for n in lengths:
                t0 = time.monotonic()
                c = compare(config, make_prompt(n, 512, seed=n), K, transfer=transfer,
                            prefill_side=pair.prefill_pools, decode_side=pair.decode_pools)
                check_served(f"{_mode(unified, draft)} tcp", c, pair.records[-1], draft=draft,
                             seconds=time.monotonic() - t0)
    # The engines chose different (shuffled) pages: the daemons moved between lists.
    for src, dst in seen:
        assert not np.array_equal(src[IndexKind.KV_PAGES], dst[IndexKind.KV_PAGES]) or \
            len(src[IndexKind.KV_PAGES]) == 1


@pytest.fixture(scope="module")
def corrupting_pair() -> Iterator[ServedPair]:
    """A pair whose decode daemon flips one landed byte of every request."""
    with ServedPair(tiny_config(unified=True, draft=True), extra=(ENABLE_FLAG,),
                    decode_env={CORRUPT_LANDED_ENV: "1"}) as pair:
        yield pair


def test_a_flipped_byte_is_caught_and_never_decoded(corrupting_pair: ServedPair) -> None:
    pair = corrupting_pair
    decoded: list[int] = []
    with torch_threads(1):
        split = SplitRun(pair.config, make_prompt(250, 512), prefill_side=pair.prefill_pools)
        with pytest.raises(TransferFailed) as info:
            decoded.append(len(split.decode(K, transfer=pair.transfer,
                                            decode_side=pair.decode_pools).tokens))
    assert not decoded  # the engine never decoded from the corrupted state
    assert info.value.reason == "integrity", str(info.value)
    rec = pair.records[-1]
    assert not rec.ok and rec.state.startswith("Failed(integrity"), rec
    assert "FAULT INJECTED" in pair.decode.output
