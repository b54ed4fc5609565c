"""The enums every layer speaks about pool contents."""

from __future__ import annotations

import enum


class StateType(enum.Enum):
    """Type of a positional state component (sglang's ``StateType`` subset used by DSV4)."""

    SWA = "SWA"
    SWA_RING = "SWA_RING"
    C128_STATE = "C128_STATE"
    #: sglang's per-request metadata row (``KVArgs.aux_*``): first output token,
    #: bootstrap room, ... (the ``sglang_mha`` kind; one ``REQ_SLOT`` item per request).
    AUX = "AUX"

    # Members are singletons: identity hashing (C) instead of Enum's hash of the name (a
    # Python call per dict lookup, some 200-300 per small request in a daemon's lists).
    __hash__ = object.__hash__


class IndexKind(enum.Enum):
    """Which per-request index list addresses a buffer's items.

    - ``KV_PAGES``: the request's full-KV pages ``[0, ceil(L / page_size))``; one
      item is one page (``page_size / ratio`` rows of a compressed layer).
    - ``SWA_PAGES``: the paged SWA pool's pages covering the window, through the
      full-to-SWA index mapping; one item is one SWA page.
    - ``SWA_RING_ROWS``: unified-KV ring rows ``slot * ring + pos % ring`` for
      the window's positions; one item is one row.
    - ``REQ_SLOT``: ``[slot]``; one item is a request's whole C4 compression-state ring
      (DSV4), or its metadata row (sglang's aux buffers, the ``sglang_mha`` kind).
    - ``C128_STATE``: the C128 compression-state item holding position ``L - 1``.
    """

    KV_PAGES = "KV_PAGES"
    SWA_PAGES = "SWA_PAGES"
    SWA_RING_ROWS = "SWA_RING_ROWS"
    REQ_SLOT = "REQ_SLOT"
    C128_STATE = "C128_STATE"

    # Members are singletons: identity hashing (C) instead of Enum's hash of the name (a
    # Python call per dict lookup, some 200-300 per small request in a daemon's lists).
    __hash__ = object.__hash__


#: Every index kind, in declaration order: iterating the enum itself runs a Python
#: generator per member (EnumType.__iter__), and the per-request paths loop over them.
INDEX_KINDS: tuple[IndexKind, ...] = tuple(IndexKind)


#: Index kinds whose source and destination lists must have exactly the same length.
#: Page kinds may be shorter on decode (its prefix cache already holds the head).
EXACT_MATCH_KINDS = frozenset({IndexKind.SWA_RING_ROWS, IndexKind.REQ_SLOT, IndexKind.C128_STATE})
