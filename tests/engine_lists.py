"""Engine-chosen index lists for tests: shuffled, fragmented picks from a layout's items."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvbeam.pools.indices import expected_lengths
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.spec import PoolSpec, load_side_config
from kvbeam.pools.types import IndexKind
from tests.fixtures import shipped_config

Lists = dict[IndexKind, npt.NDArray[np.int64]]


def kind_items(layout: SideLayout, pool: str | None = None) -> dict[IndexKind, int]:
    """Items every buffer of a kind has (the smallest), over one pool or all."""
    out: dict[IndexKind, int] = {}
    for comp in layout.components:
        if pool is None or comp.pool == pool:
            for b in comp.buffers:
                out[b.index_kind] = min(out.get(b.index_kind, b.items), b.items)
    return out


def random_lists(spec: PoolSpec, layout: SideLayout, seq_len: int, rng: np.random.Generator,
                 pool: str | None = None, taken: dict[IndexKind, set[int]] | None = None) -> Lists:
    """Distinct random items per kind the layout (or ``pool``) uses, the lengths seq_len needs.

    Random picks without replacement from the whole pool: out of order and fragmented,
    as an engine's free list hands them out. ``taken``: items other live requests hold,
    never picked, and this request's picks are added to it (decode refuses two live
    reservations naming one item).
    """
    want = expected_lengths(spec, seq_len)
    lists: Lists = {}
    for kind, items in kind_items(layout, pool).items():
        if taken is None:
            lists[kind] = rng.choice(items, size=want[kind], replace=False).astype(np.int64)
            continue
        held = taken.setdefault(kind, set())
        population = np.arange(items) if np.ndim(items) == 0 else np.asarray(items)
        free = np.array([i for i in population.tolist() if i not in held], np.int64)
        lists[kind] = rng.choice(free, size=want[kind], replace=False).astype(np.int64)
        held.update(lists[kind].tolist())
    return lists


def as_mapping(target: Lists, draft: Lists | None = None) -> dict[str, list[int]]:
    """Lists as the client takes them: kind name -> ints, "draft.KIND" for the draft's."""
    out = {k.value: v.tolist() for k, v in target.items()}
    out.update({f"draft.{k.value}": v.tolist() for k, v in (draft or {}).items()})
    return out


def shipped_lists(role: str, paged: bool, seq_len: int, seed: int,
                  own_draft: bool = False) -> tuple[Lists, Lists]:
    """Random (target, draft) lists for the shipped config of ``role``; draft empty unless asked."""
    cfg = load_side_config(shipped_config(role, paged))
    lay = build_side_layout(cfg)
    rng = np.random.default_rng(seed)
    draft = random_lists(cfg.target, lay, seq_len, rng, pool="draft") if own_draft else {}
    return random_lists(cfg.target, lay, seq_len, rng), draft
