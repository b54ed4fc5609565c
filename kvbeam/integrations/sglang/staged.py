"""sglang's KV pool and metadata rows staged through a host buffer (no sglang import).

A kvbeam daemon maps host memory only. With its pool on a GPU (always), or when asked
(``KVBEAM_STAGING=1`` / ``server_args.kvbeam_staging``: the pool's ordinary CPU tensors
then stay where sglang put them), the backend attaches a host staging buffer of the
pools' geometry (:class:`~kvbeam.engine.staging.StagingBuffer`) instead of the pool:
prefill gathers a finished request's pages, states and metadata row into staging items
and sends from them; decode reserves staging items and, after Success, scatters them
into sglang's pool and metadata rows before its poll says Success
(:mod:`kvbeam.integrations.sglang.conn`). The copies run in sglang's scheduler, at its
own calls (send, poll): none blocks (a full buffer makes a request wait at most
``KVBEAM_STAGING_WAIT_S``, asked again at each poll, then fails it; on CUDA the copies
run on a side stream and the poll reads their events).

Settings (a ``server_args.kvbeam_*`` attribute when present, else the environment):
``kvbeam_staging`` / ``KVBEAM_STAGING`` (``1``: stage, ``0``: never, refused for a GPU
pool; unset: stage exactly when the pool is not on the CPU), ``KVBEAM_STAGING_REQUESTS``
(4), ``KVBEAM_STAGING_TOKENS`` (the server's ``--context-length``, else the pool's
token rows over the requests: the buffer then holds as many tokens as the pool, as
NixlConnector's host buffer does), ``KVBEAM_STAGING_WAIT_S`` (5). docs/sglang.md,
"Staging".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbeam.engine.staging import StagingBuffer, StagingMetrics, TensorKV
from kvbeam.errors import ConfigError
from kvbeam.integrations.sglang.kvargs import kvargs_components
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Seconds between two INFO lines of a staging buffer's figures (only when they moved).
REPORT_S = 10.0


def _value(server_args: Any, name: str) -> str:
    value = getattr(server_args, name, None)
    return str(value if value is not None else os.environ.get(name.upper(), "")).strip()


def staging_requested(server_args: Any = None) -> bool | None:
    """``kvbeam_staging`` / ``KVBEAM_STAGING``: True (stage), False (never), None (unset:
    stage exactly when the pool is not on the CPU).

    Raises:
        ConfigError: a value that is not a boolean.
    """
    value = _value(server_args, "kvbeam_staging").lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"KVBEAM_STAGING={value!r}: 1 (stage sglang's pool through a host "
                      "buffer), 0 (never), or unset (stage a GPU pool)")


@dataclass(frozen=True)
class Capacity:
    """The staging buffer's size and wait (:class:`~kvbeam.engine.staging.StagingBuffer`)."""

    requests: int = 4
    tokens: int | None = None
    wait_s: float = 5.0

    @classmethod
    def read(cls, server_args: Any) -> Capacity:
        """``KVBEAM_STAGING_REQUESTS``, ``_TOKENS`` and ``_WAIT_S`` (the server's
        ``context_length`` is the default request length).

        Raises:
            ConfigError: a value that is not a positive number, naming the variable.
        """
        out: dict[str, Any] = {}
        for key, kind in (("requests", int), ("tokens", int), ("wait_s", float)):
            text = _value(server_args, f"kvbeam_staging_{key}")
            if not text:
                continue
            try:
                value = kind(text)
            except ValueError:
                value = -1
            if value < (0 if key == "wait_s" else 1):
                want = "seconds >= 0" if key == "wait_s" else "a whole number >= 1"
                raise ConfigError(f"KVBEAM_STAGING_{key.upper()}={text!r}: {want} is needed")
            out[key] = value
        if "tokens" not in out:
            context = getattr(server_args, "context_length", None)
            if isinstance(context, int) and context > 0:
                out["tokens"] = context
        return cls(**out)


def pool_tensors(pool: Any, metadata: Any) -> list[torch.Tensor]:
    """Every tensor the pools' transfer pointers may name: sglang's MHA pool's K and V
    buffers, and its metadata rows (the fields that exist)."""
    from kvbeam.integrations.sglang.memory import METADATA_FIELDS

    out = [*pool.k_buffer, *pool.v_buffer]
    if metadata is not None:
        out += [t for t in (getattr(metadata, f, None) for f in METADATA_FIELDS)
                if t is not None]
    return out


def pool_device(tensors: Sequence[torch.Tensor]) -> str:
    """Where the pool lives: its first tensor's device (``cpu``, ``cuda:0``...)."""
    return str(tensors[0].device) if tensors else "cpu"


def device_kv(kv_args: Any, layout: SideLayout, tensors: Sequence[torch.Tensor]) -> TensorKV:
    """sglang's pool and metadata rows as the staging buffer's device KV: the tensor at
    each pointer ``KVArgs`` gives, in the layout's buffer order.

    Raises:
        ConfigError: a pointer no tensor starts at, or a length that is not its tensor's.
    """
    by_ptr = {int(t.data_ptr()): t for t in tensors}
    out = []
    for ci, (kind, ptrs, lens, _) in enumerate(kvargs_components(kv_args, layout)):
        for bi, (ptr, n) in enumerate(zip(ptrs, lens, strict=True)):
            t = by_ptr.get(int(ptr))
            if t is None or t.numel() * t.element_size() != n:
                raise ConfigError(f"staging: KVArgs component {ci} ({kind}) buffer {bi} at "
                                  f"{int(ptr):#x} ({n} bytes) is none of sglang's pool "
                                  "tensors: kvbeam stages sglang's MHA pool and metadata "
                                  "rows only")
            out.append(t)
    return TensorKV(layout, out)


def device_lists(lists: Mapping[str, Any]) -> dict[IndexKind, Any]:
    """A request's lists by kind name as the staging buffer takes them (by kind).

    Raises:
        ConfigError: a draft pool's own list (``draft.KIND``): not staged.
    """
    out = {}
    for name, lst in lists.items():
        if "." in name:
            raise ConfigError(f"staging: {name}: a draft pool's own lists are not staged")
        out[IndexKind(name)] = lst
    return out


def staging_buffer(config: SideConfig, device: str, capacity: Capacity) -> StagingBuffer:
    """The staging buffer for sglang's pools (``device``: where the pool lives); without
    a request length, the pool's tokens shared by the requests."""
    tokens = capacity.tokens or max(1, config.target.max_context_len // capacity.requests)
    return StagingBuffer(config, device=device, requests=capacity.requests, tokens=tokens,
                         wait_s=capacity.wait_s)


class StagingLog:
    """An INFO line of a staging buffer's figures at most every :data:`REPORT_S` seconds,
    when they moved (sglang's log is where its users look)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._next = 0.0
        self._last: tuple[int, int, int, int] | None = None

    def maybe(self, buffer: StagingBuffer, now: float | None = None) -> str:
        """Log the figures when due and changed; the line logged ("" : none)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return ""
        self._next = now + REPORT_S
        m = buffer.metrics
        key = (m.requests_out, m.requests_in, m.refusals, m.held)
        if key == self._last:
            return ""
        self._last = key
        line = describe(self.role, m)
        log.info("%s", line)
        return line


def describe(role: str, m: StagingMetrics) -> str:
    """A staging buffer's figures as one line."""
    return (f"kvbeam staging ({role}): {m.requests_out} request(s) gathered "
            f"({m.bytes_out / 2**20:.1f} MiB, copies {1e3 * m.copy_out_s:.1f} ms), "
            f"{m.requests_in} scattered ({m.bytes_in / 2**20:.1f} MiB, copies "
            f"{1e3 * m.copy_in_s:.1f} ms); {m.waits} waited for room, {m.refusals} refused; "
            f"occupancy {100 * m.occupancy:.0f}% ({m.held} held, {m.waiting} waiting)")
