"""Prefill TP 1 into decode TP 2 through real daemons: each decode rank gets its heads.

A prefill ``--pools engine`` daemon with a tests/channel_engine.py engine holding all 4
KV heads (a paged LBHNC pool, TP rank 0 of 1), and two decode daemons, each with an
engine holding 2 heads (rank 0 and rank 1 of 2): the daemons a vLLM TP 2 decode's two
workers attach to. Prefill sends one transfer per decode rank (``ID.r0``, ``ID.r1``,
the same source pages); each decode block must hold exactly its rank's head slice of
prefill's block (compared head slice by head slice), integrity-verified (prefill
digests the window it moved), and only those bytes move. A decode rank whose block
layout does not put heads outermost is refused at the handshake, naming it on both
daemons.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
from kvbeam.pools.spec import PoolSpec
from kvbeam.procs import DaemonProcess
from kvbeam.states import VERIFIED_PREFIX
from tests.attach_helpers import start_engine_daemon, write_config
from tests.daemon_helpers import FAST
from tests.host.test_engine_channel import ChannelEngine
from tests.metrics_helpers import scrape, value
from tests.waiting import wait_until

HEADS = 4
LAYERS = 2
SEQ = 300  # 19 pages of 16 tokens


def spec(tp_size: int, tp_rank: int, inner_layout: str = "LBHNC") -> PoolSpec:
    return paged_spec(num_layers=LAYERS, block_size=16, num_kv_heads=HEADS // tp_size,
                      head_size=64, dtype="bfloat16", inner_layout=inner_layout,
                      num_blocks=128, tp_rank=tp_rank, tp_size=tp_size)


PAGES = -(-SEQ // 16)


@dataclass
class Fleet:
    prefill: DaemonProcess
    decode: list[DaemonProcess]  # rank 0, rank 1, then the not-heads-outermost rank
    pe: ChannelEngine
    de: list[ChannelEngine]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp: Path = tmp_path_factory.mktemp("tp")
    tmp.chmod(0o700)
    configs = [("p", spec(1, 0)), ("d0", spec(2, 0)), ("d1", spec(2, 1)),
               ("dx", spec(2, 0, inner_layout="NHD"))]
    daemons: list[DaemonProcess] = []
    engines: list[ChannelEngine] = []
    try:
        for i, (name, s) in enumerate(configs):
            sock = str(tmp / f"{name}.sock")
            daemons.append(start_engine_daemon("prefill" if name == "p" else "decode", sock,
                                               deadlines=FAST))
            cfg = write_config(tmp / f"{name}.yaml", paged_side_config("tp-test", s))
            engines.append(ChannelEngine(sock, cfg, seed=1 + i))
        yield Fleet(daemons[0], daemons[1:], engines[0], engines[1:])
    finally:
        for e in engines:
            e.stop()
        for d in daemons:
            d.stop()


def _bytes(daemon: DaemonProcess) -> float:
    return value(scrape(daemon.metrics), "kvbeam_request_bytes_total")


@pytest.mark.parametrize("reserve_first", [True, False], ids=["reserve-first", "send-first"])
def test_each_decode_rank_gets_exactly_its_head_slice(fleet: Fleet, reserve_first: bool
                                                      ) -> None:
    rid = f"tp-{reserve_first}"
    before = [_bytes(d) for d in fleet.decode[:2]] + [_bytes(fleet.prefill)]
    for rank in (0, 1):
        reserve = f"reserve {rid}.r{rank} {SEQ} {fleet.prefill.address} {11 + rank}"
        send = f"send {rid}.r{rank} {SEQ} {fleet.decode[rank].address} 21"  # same pages
        first, then = ((fleet.de[rank], reserve), (fleet.pe, send))
        if not reserve_first:
            first, then = then, first
        assert first[0].cmd(first[1]).startswith(("reserve", "send"))
        assert then[0].cmd(then[1]).startswith(("reserve", "send"))
    per_rank = HEADS // 2
    for rank in (0, 1):
        sub = f"{rid}.r{rank}"
        assert fleet.de[rank].cmd(f"wait {sub} 60") == "Success"
        assert fleet.pe.cmd(f"wait {sub} 60") == "Success"
        landed = fleet.de[rank].cmd(f"heads {sub} 0 {per_rank}")
        assert landed == fleet.pe.cmd(f"heads {sub} {rank * per_rank} {per_rank}")
        other = (1 - rank) * per_rank  # the other rank's heads are not what landed here
        assert landed != fleet.pe.cmd(f"heads {sub} {other} {per_rank}")
        with KvbeamClient(fleet.decode[rank].address) as d:
            detail = d.status(sub).detail
            assert detail.startswith(VERIFIED_PREFIX), detail
        assert fleet.de[rank].cmd(f"release {sub}") == "released"
    moved = PAGES * LAYERS * block_bytes(spec(2, 0))  # each rank's half of the blocks
    assert [_bytes(d) - b for d, b in zip(fleet.decode[:2], before, strict=False)] == [moved,
                                                                                      moved]
    assert _bytes(fleet.prefill) - before[2] == 2 * moved


def test_a_decode_rank_without_heads_outermost_is_refused_on_both_daemons(fleet: Fleet) -> None:
    bad, engine = fleet.decode[2], fleet.de[2]
    assert engine.cmd(f"reserve nhd {SEQ} {fleet.prefill.address} 13") == "reserve nhd"
    assert fleet.pe.cmd(f"send nhd {SEQ} {bad.address} 23") == "send nhd"
    answer = fleet.pe.cmd("wait nhd 60")
    assert answer.startswith("Failed incompatible:"), answer
    want = ("prefill and decode pools differ in tensor-parallel sizes differ (prefill=1, "
            "decode=2), which needs a block layout with KV heads outermost (LBHNC): block "
            "inner layout prefill=LBHNC, decode=NHD")
    assert want in answer, answer
    assert wait_until(lambda: any(want in line for line in bad.lines), 10.0), bad.output
    assert engine.cmd("wait nhd 60").startswith("Failed"), "decode's reservation never lands"
