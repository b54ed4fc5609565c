"""What sglang 0.5.23's own schedulers read beyond the base classes (prefill.py, decode.py).

Kept apart from the transfer calls (:mod:`kvbeam.integrations.sglang.conn`):

- :class:`ManagerMembers`: decode's ``prefill_info_table`` and
  ``try_ensure_parallel_info(addr)`` (decode looks prefill up before it creates a
  receiver's transfer), and prefill's self-registration at its bootstrap server
  (sglang 0.5.23 calls ``register_to_bootstrap()`` only from its common manager's
  ``__init__``, which kvbeam's does not inherit);
- :class:`ReceiverMembers`: ``kv_mgr``, ``conclude_state``, ``require_staging``,
  ``abort_notified``, ``bootstrap_infos`` and ``ensure_abort_notified()``;
- :func:`aux_lists`: the request's metadata row (``aux_index``, sglang's
  ``metadata_buffer_index``) as the ``REQ_SLOT`` list of the AUX component, so the row
  moves with the KV through the daemons;
- :func:`prefill_poll` and :func:`decode_poll`: the states sglang's queues accept;
- :func:`decode_seq_len`: the request length decode reserves with, from its own lists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbeam.auth import Security
from kvbeam.engine.requests import KVPoll
from kvbeam.integrations.sglang import bootstrap
from kvbeam.integrations.sglang.kvargs import has_aux
from kvbeam.pools.indices import expected_lengths
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.types import IndexKind

log = logging.getLogger(__name__)

#: The bootstrap key prefill's daemon address is registered under.
PREFILL_KEY = "kvbeam.prefill"
#: How long prefill retries its registration while its bootstrap server starts (sglang
#: starts it in the HTTP server's process, beside the scheduler that registers).
REGISTER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PrefillInfo:
    """What decode's scheduler reads of a prefill (``prefill_info_table`` values):
    kvbeam's prefill is one daemon, one data-parallel rank."""

    daemon: str
    dp_size: int = 1
    follow_bootstrap_room: bool = True


class ManagerMembers:
    """The manager's members sglang's schedulers read (mixed into the kvbeam manager)."""

    server_args: Any
    daemon: str
    #: the credentials the manager presents (its bootstrap calls carry the token)
    security: Security

    def _init_scheduler_members(self) -> None:
        self.prefill_info_table: dict[str, PrefillInfo] = {}

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: look prefill's daemon up at ``bootstrap_addr``; True once known."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            value = bootstrap.call(bootstrap_addr, "get", PREFILL_KEY, timeout=2.0,
                                   token=self.security.token)
        except OSError as exc:  # its bootstrap server is not up yet: sglang retries
            log.info("kvbeam: prefill bootstrap %s not reachable yet: %s", bootstrap_addr, exc)
            return False
        if not isinstance(value, dict) or not isinstance(value.get("daemon"), str):
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(value["daemon"])
        return True

    def bootstrap_address(self) -> str:
        """This prefill server's bootstrap address (``--host``, bootstrap port)."""
        host = getattr(self.server_args, "host", None) or "127.0.0.1"
        return f"{host}:{self.server_args.disaggregation_bootstrap_port}"

    def registration(self) -> dict[str, Any]:
        """What prefill publishes at its bootstrap server (the manager adds its pools)."""
        return {"daemon": self.daemon}

    def register_to_bootstrap(self) -> None:
        """Prefill: publish the daemon's address (and its pools' description) at this
        server's bootstrap server, retrying while it starts (up to
        :data:`REGISTER_TIMEOUT_S`)."""
        address = self.bootstrap_address()
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while True:
            try:
                bootstrap.call(address, "put", PREFILL_KEY, self.registration(),
                               token=self.security.token)
                log.info("kvbeam: prefill daemon %s registered at bootstrap %s", self.daemon,
                         address)
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvbeam: prefill could not register at its bootstrap "
                                       f"server {address} within {REGISTER_TIMEOUT_S:.0f} s: "
                                       f"{exc}") from exc
            time.sleep(0.2)


class ReceiverMembers:
    """The receiver's members decode's scheduler reads (mixed into the kvbeam receiver)."""

    mgr: Any

    def _init_scheduler_members(self) -> None:
        #: decode's allocation policy reads it after init(): Failed when init failed
        self.conclude_state: int | None = None
        #: sglang's own staging handler stays off: kvbeam's staging (a GPU pool) scatters
        #: into the pool before the poll says Success (kvbeam.integrations.sglang.staged)
        self.require_staging = False
        #: True once prefill was told of this request's abort (through the daemons)
        self.abort_notified = False
        #: per-prefill-rank acknowledgements a deferred release waits for (none: kvbeam
        #: aborts synchronously at its daemon)
        self.bootstrap_infos: list[Any] = []

    @property
    def kv_mgr(self) -> Any:
        """The manager (sglang's name for it)."""
        return self.mgr

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """Tell prefill (through the daemons) that decode gave this request up, once."""
        if not self.abort_notified:
            self.abort()  # type: ignore[attr-defined]  # the receiver's own
            self.abort_notified = True


def aux_lists(layout: SideLayout, aux_index: int | None) -> dict[str, list[int]]:
    """The metadata row's index list (``REQ_SLOT``) when ``layout`` moves sglang's
    metadata buffers; nothing otherwise.

    Raises:
        ValueError: the layout moves metadata rows and sglang gave no ``aux_index``.
    """
    if not has_aux(layout):
        return {}
    if aux_index is None or int(aux_index) < 0:
        raise ValueError(f"the sglang_mha layout moves the metadata row, but sglang gave "
                         f"aux_index {aux_index!r}")
    return {"REQ_SLOT": [int(aux_index)]}


def prefill_poll(state: int) -> int:
    """kvbeam's poll as sglang's prefill inflight queue accepts it: the reservation and
    kvbeam's own handshake (Bootstrapping) are Transferring there (sglang 0.5.23 raises
    on Bootstrapping in that queue)."""
    return int(KVPoll.Transferring) if state == int(KVPoll.Bootstrapping) else state


def decode_poll(state: int) -> int:
    """kvbeam's poll as sglang's decode transfer queue reads it once the metadata went
    out: the reservation waiting for prefill's first write (Bootstrapping at the daemon)
    is WaitingForInput there, as sglang's own backends report it."""
    return int(KVPoll.WaitingForInput) if state == int(KVPoll.Bootstrapping) else state


def decode_seq_len(spec: PoolSpec, lists: Mapping[str, Any]) -> int:
    """The request length decode reserves with, from the destination lists sglang gave.

    sglang hands decode's backend page ids, not the request's token count; kvbeam needs
    a ``seq_len`` whose lists have exactly these lengths
    (:func:`~kvbeam.pools.indices.expected_lengths`). The KV page count bounds it to one
    page, ``((n - 1) * page_size, n * page_size]``; token-granular lists (SWA ring rows
    shorter than the ring) pin it. The longest length consistent with every target list
    is taken: prefill then sends with this length (decode's is authoritative,
    docs/sglang.md), after checking its own token count needs the same lists.

    Raises:
        ValueError: no length in that page gives the lists' lengths.
    """
    given = {IndexKind(k): len(v) for k, v in lists.items() if "." not in k}
    pages = given.get(IndexKind.KV_PAGES, 0)
    if pages <= 0:
        raise ValueError("decode's metadata has no KV pages: kvbeam cannot reserve an empty "
                         "request")
    top: int = min(pages * int(spec.page_size), int(spec.max_context_len))
    low: int = (pages - 1) * int(spec.page_size) + 1
    ring = given.get(IndexKind.SWA_RING_ROWS)
    hints = [ring] if ring is not None and low <= ring <= top else []
    candidates: list[int] = [top, *hints, *range(top - 1, low - 1, -1)]
    for seq_len in candidates:
        want = expected_lengths(spec, seq_len)
        if all(want.get(kind, 0) == n for kind, n in given.items()):
            return seq_len
    raise ValueError(f"decode's lists ({', '.join(f'{k.value} {n}' for k, n in given.items())}) "
                     f"fit no request of {low}..{top} tokens (page_size {spec.page_size})")


def same_lists(spec: PoolSpec, layout: SideLayout, a: int, b: int) -> bool:
    """Whether requests of ``a`` and ``b`` tokens move lists of the same lengths, for
    every index kind ``layout``'s buffers use."""
    if a == b:
        return True
    used = {buf.index_kind for comp in layout.components for buf in comp.buffers}
    la, lb = expected_lengths(spec, a), expected_lengths(spec, b)
    return all(la.get(kind) == lb.get(kind) for kind in used)
