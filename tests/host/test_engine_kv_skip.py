"""Partial loads (``kv_skip``) and declines over the engine channel, TCP daemons.

Two ``--pools engine`` daemons over TCP and two tests/channel_engine.py processes
with a paged pool (vLLM's shape: KV pages only). Decode's engine holds the head of a
request (a prefix cache) and reserves only the pages after it: prefill writes and
digests only its pages from ``kv_skip`` on, decode's held pages stay untouched, and
the daemons count only the moved bytes. A request decode will not load is declined:
prefill's send fails at once ("declined by decode"), well inside its lease. Refusals
name ``kv_skip`` and the values it was checked against.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.errors import BadRequest
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
from kvbeam.procs import DaemonProcess
from kvbeam.states import VERIFIED_PREFIX, TransferState
from tests.attach_helpers import write_config
from tests.daemon_helpers import FAST
from tests.host.test_engine_channel import ChannelEngine, _until, attached_pair
from tests.metrics_helpers import scrape, value
from tests.waiting import wait_until

SPEC = paged_spec(num_layers=4, block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16",
                  inner_layout="LBHNC", num_blocks=512)
SEQ = 700  # 44 pages of 16 tokens
PAGES = -(-SEQ // SPEC.page_size)
LAYERS = 4
PAGE_BYTES = LAYERS * block_bytes(SPEC)  # one page over every layer
#: Longer than any wait below: a send that ends sooner was not ended by its lease.
SEND_WAIT_S = 120

Engines = tuple[DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """(prefill daemon, decode daemon, prefill engine, decode engine), paged pools."""
    tmp = tmp_path_factory.mktemp("kvskip")
    tmp.chmod(0o700)
    cfg = write_config(tmp / "paged.yaml", paged_side_config("paged-test", SPEC))
    with attached_pair(tmp, cfg, [*FAST, "--send-wait-s", str(SEND_WAIT_S)]) as four:
        yield four


def _bytes(daemon: DaemonProcess) -> float:
    return value(scrape(daemon.metrics), "kvbeam_request_bytes_total")


@pytest.mark.parametrize(("rid", "skip", "send_first"), [
    ("shared", 30, False),   # a shared prefix held: the other 14 pages move
    ("repeat", PAGES - 1, True),  # a repeated prompt: all but the last page held (vLLM's order)
    ("none", 0, True),       # nothing held: the whole request, as before
])
def test_decode_holding_a_prefix_gets_only_the_pages_after_it(
        engines: Engines, rid: str, skip: int, send_first: bool) -> None:
    prefill, decode, pe, de = engines
    before = (_bytes(prefill), _bytes(decode))
    if send_first:  # prefill's send waits for decode's reservation (its Offer)
        assert pe.cmd(f"send {rid} {SEQ} {decode.address} 21") == f"send {rid}"
        assert _until(pe, rid, "WaitingForInput") == "WaitingForInput"
    assert de.cmd(f"reserve {rid} {SEQ} {prefill.address} 11 {skip}") == f"reserve {rid}"
    held = de.cmd(f"digests {rid} 0 {skip}")  # decode's own pages of the prefix
    if not send_first:
        assert pe.cmd(f"send {rid} {SEQ} {decode.address} 21") == f"send {rid}"
    assert de.cmd(f"wait {rid} 60") == "Success"
    assert pe.cmd(f"wait {rid} 60") == "Success"
    # Decode's pages after the prefix hold prefill's from kv_skip on; its held ones
    # were not written (they differ from prefill's, whose pattern is another seed).
    assert de.cmd(f"digests {rid} {skip}") == pe.cmd(f"digests {rid} {skip}")
    assert de.cmd(f"digests {rid} 0 {skip}") == held
    if skip:
        assert held != pe.cmd(f"digests {rid} 0 {skip}")
    moved = (PAGES - skip) * PAGE_BYTES
    assert (_bytes(prefill) - before[0], _bytes(decode) - before[1]) == (moved, moved)
    with KvbeamClient(decode.address) as d:  # integrity on: the moved pages verified
        assert d.status(rid).detail.startswith(VERIFIED_PREFIX), d.status(rid).detail
    assert de.cmd(f"release {rid}") == "released"


def test_a_kv_skip_that_leaves_nothing_or_misnames_the_pages_is_refused(
        engines: Engines) -> None:
    prefill, decode, _pe, de = engines
    assert de.cmd(f"reserve all {SEQ} {prefill.address} 12 {PAGES}") == "reserve all"
    answer = de.cmd("wait all 30")
    assert answer.startswith("Failed invalid_request: kv_skip: BadKvSkip: decode: kv_skip "
                             f"{PAGES} leaves no KV page of the request's {PAGES}"), answer
    assert "(DECLINE), not reserved" in answer
    with KvbeamClient(decode.address) as d:  # the scheduler API's Reserve checks the same
        with pytest.raises(BadRequest, match=f"kv_skip 30: KV_PAGES has {PAGES} indices; "
                           f"{SEQ} tokens less the 30 pages held need {PAGES - 30}"):
            d.reserve("whole", SEQ, prefill.address,
                      indices={"KV_PAGES": list(range(PAGES))}, kv_skip=30)
        with pytest.raises(BadRequest, match="kv_skip 5 needs the engine's index lists"):
            d.reserve("slots", SEQ, prefill.address, kv_skip=5)
        with pytest.raises(BadRequest, match="kv_skip -1: a count of leading KV pages"):
            d.reserve("neg", SEQ, prefill.address, indices={"KV_PAGES": [1]}, kv_skip=-1)
        assert d.capacity().slots_held == 0  # nothing was held by a refusal


def _declines_reach(decode: DaemonProcess, count: float) -> bool:
    """Whether decode's ``kvbeam_declines_total`` reaches ``count`` within 10 s."""
    return wait_until(lambda: value(scrape(decode.metrics), "kvbeam_declines_total") >= count,
                      10.0)


def test_a_declined_request_frees_prefill_at_once(engines: Engines) -> None:
    prefill, decode, pe, de = engines
    # A first request connects the daemons (a decline goes over that connection).
    assert de.cmd(f"reserve warm {SEQ} {prefill.address} 13") == "reserve warm"
    assert pe.cmd(f"send warm {SEQ} {decode.address} 23") == "send warm"
    assert de.cmd("wait warm 60") == "Success"
    assert de.cmd("release warm") == "released"
    before = value(scrape(decode.metrics), "kvbeam_declines_total")
    assert pe.cmd(f"send dcl {SEQ} {decode.address} 24") == "send dcl"
    assert _until(pe, "dcl", "WaitingForInput") == "WaitingForInput"  # held for decode
    assert de.cmd(f"decline dcl {prefill.address}") == "declined"
    answer = pe.cmd("wait dcl 60")  # inside the 120 s lease: the decline ended it
    assert answer.startswith("Failed peer_failed: declined by decode: the test engine will "
                             "not load it"), answer
    # Counted once prefill confirmed the Abort, which may be after prefill's engine saw it.
    assert _declines_reach(decode, before + 1)
    with KvbeamClient(prefill.address) as p:
        assert p.status("dcl").state is TransferState.FAILED
    # Declined before prefill's engine sent it (vLLM's prefill sends after it answered
    # the client): the Send that comes later fails at once, not at its lease.
    assert de.cmd(f"decline early {prefill.address}") == "declined"
    assert _declines_reach(decode, before + 2)
    assert pe.cmd(f"send early {SEQ} {decode.address} 25") == "send early"
    answer = pe.cmd("wait early 60")
    assert answer.startswith("Failed peer_failed: declined by decode: the test engine will "
                             "not load it"), answer
