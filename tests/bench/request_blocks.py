"""A whole request's block list as kvbeam's planner makes it, for peers that move raw blocks.

The request benchmark sends requests through the daemons (shipped dsv4-tiny configs,
unified); a peer such as Mooncake TE moves the same request's blocks (same bytes,
same block boundaries and sizes) between two plain buffers. :func:`request_case`
builds the index lists both use (slot-contiguous, or engine-chosen ones from a
seeded generator, so the peer's child process and the benchmark get the same
lists), and :func:`request_blocks` plans them with
:func:`kvbeam.pools.plan.build_plan`, each buffer placed at its offset in one
contiguous region per side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.plan import build_plan
from kvbeam.pools.spec import SideConfig, load_side_config
from kvbeam.transport.blocks import Blocks
from tests.bench.bench_engine_indices import page_lists
from tests.engine_lists import Lists, as_mapping, random_lists
from tests.fixtures import shipped_config

#: Index-list styles (docs/performance.md, "Engine-chosen lists"): slot-contiguous,
#: pages shuffled over the pool, everything shuffled.
STYLES = ("slot", "pages", "engine")


@dataclass(frozen=True)
class RequestCase:
    """One request: its length, list style and both sides' index lists by kind."""

    tokens: int
    style: str
    src: Lists
    dst: Lists

    def client_lists(self) -> tuple[dict[str, list[int]] | None, dict[str, list[int]] | None]:
        """(src, dst) as :func:`kvbeam.scheduler.run_request` takes them; None for slot lists
        (the daemons then use their slots' own lists, which plan to the same blocks)."""
        if self.style == "slot":
            return None, None
        return as_mapping(self.src), as_mapping(self.dst)


def _sides(paged: bool = False) -> tuple[SideConfig, SideLayout, SideConfig, SideLayout]:
    pcfg, dcfg = (load_side_config(shipped_config(role, paged)) for role in ("prefill", "decode"))
    return pcfg, build_side_layout(pcfg), dcfg, build_side_layout(dcfg)


def request_case(tokens: int, style: str, seed: int = 3) -> RequestCase:
    """The index lists of a ``tokens`` request in ``style`` (seeded: the same in every process)."""
    pcfg, play, dcfg, dlay = _sides()
    if style == "slot":
        return RequestCase(tokens, style, dict(request_indices(pcfg.target, 0, tokens)),
                           dict(request_indices(dcfg.target, 0, tokens)))
    if style not in STYLES:
        raise ValueError(f"unknown list style {style!r} (one of {', '.join(STYLES)})")
    rng = np.random.default_rng(seed)
    pick = random_lists if style == "engine" else page_lists
    return RequestCase(tokens, style, pick(pcfg.target, play, tokens, rng),
                       pick(dcfg.target, dlay, tokens, rng))


def _offsets(lay: SideLayout) -> list[int]:
    """Each buffer's offset when the side's buffers are laid end to end."""
    sizes = [b.nbytes for b in lay.flat_buffers]
    return [int(x) for x in np.concatenate(([0], np.cumsum(sizes)[:-1]))]


def region_sizes() -> tuple[int, int]:
    """Bytes of the source and destination regions (every buffer of each side, end to end)."""
    _, play, _, dlay = _sides()
    return (sum(b.nbytes for b in play.flat_buffers), sum(b.nbytes for b in dlay.flat_buffers))


def request_blocks(case: RequestCase) -> Blocks:
    """The request's blocks as offsets into the source and destination regions."""
    _, play, _, dlay = _sides()
    return build_plan(play, _offsets(play), case.src, dlay, _offsets(dlay), case.dst).blocks
