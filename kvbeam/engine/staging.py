"""Staging: an engine whose KV is not host shared memory moves it through a host buffer.

An engine's KV cache on a GPU (or in any tensors that are not attached memfds) cannot
be mapped by its daemon. The engine then attaches a **staging buffer** instead: a
side's pools in sealed memfds (:class:`~kvbeam.engine.EnginePools`, attached exactly
like an engine's own pools), of a capacity of its own (:func:`staging_config`), pinned
for CUDA when the KV is on a GPU (:class:`~kvbeam.engine.pinning.PinnedHost`). The
daemons see host memory as ever; the engine process, which owns the device, copies:

- prefill: :meth:`StagingBuffer.stage_out` gathers a finished request's items (its
  device index lists) into free staging items and returns them as :class:`Staged`:
  wait for its copy (``staged.copy.wait()``: on CUDA the gather runs on a side stream,
  after the engine's current stream) and send ``staged.lists`` instead of the device
  lists; release the staging items once the send ended (Success or Failed).
- decode: :meth:`StagingBuffer.reserve` takes staging items for the request's device
  lists; reserve (``send_metadata``) with ``staged.lists``; after Success,
  :meth:`StagingBuffer.stage_in` scatters them into the device items (wait for its
  copy) BEFORE the engine is told the KV is loaded; then release.

The same code runs on CPU tensors (the reference engine's ``--device cpu``, the tests):
the copies are then synchronous. When the buffer is full, a request waits up to
``wait_s`` for another to release its items, then :class:`~kvbeam.errors.StagingFull`
says so with the engine's policy (fail or recompute): never a hang. An engine loop that
must not block takes a place in the queue instead (:meth:`StagingBuffer.queue`), asks
at each step (:meth:`StagingBuffer.poll_room`) and passes the items it got to
``stage_out`` / ``reserve`` (``slots=``). :attr:`StagingBuffer.metrics` counts staged
bytes, copy time, waits and occupancy. :class:`TensorKV` is the device KV of an engine
that holds one tensor per buffer (vLLM's layers, sglang's K/V buffers and metadata
rows); a buffer may live on the CPU beside CUDA ones (sglang's metadata rows).
docs/gpu.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from kvbeam.engine.memory import EnginePools
from kvbeam.engine.staging_slots import FullPolicy, SlotAllocator, Slots, Ticket
from kvbeam.errors import ConfigError, PlanError
from kvbeam.pools.engine_indices import ListLike
from kvbeam.pools.layout import BufferLayout, SideLayout, build_side_layout
from kvbeam.pools.spec import PAGED_KINDS, PoolSpec, SideConfig
from kvbeam.pools.types import IndexKind

if TYPE_CHECKING:
    import torch

    from kvbeam.engine.pinning import PinnedHost

log = logging.getLogger(__name__)

#: Device index lists by kind: what an engine names a request's items with.
DeviceLists = Mapping[IndexKind, ListLike]


class KVMemory(Protocol):
    """An engine's KV memory (any device): its layout and a byte view of each buffer.

    kvbeam's :class:`~kvbeam.pools.allocate.AllocatedSide` (``device="cuda"`` or
    ``"cpu"``) is one; so is any object with these two members over the engine's own
    tensors. Its layout must be :func:`build_side_layout` of the engine's config.
    """

    @property
    def layout(self) -> SideLayout:
        """The side's layout (buffers in positional order)."""
        ...

    def buffer_view(self, buf: BufferLayout) -> torch.Tensor:
        """The buffer's bytes as a flat ``uint8`` tensor sharing the memory."""
        ...


class TensorKV:
    """An engine's KV memory held as one tensor per buffer: ``tensors[i]`` holds the
    bytes of ``layout.flat_buffers[i]`` (``items`` rows of ``item_len`` bytes, rows dense
    and in order; any dtype, any device; the tensors need not share an allocation).

    Raises:
        ConfigError: a tensor's size is not its buffer's bytes, or its rows are not
            dense (one byte run per buffer).
    """

    def __init__(self, layout: SideLayout, tensors: Sequence[torch.Tensor]) -> None:
        buffers = layout.flat_buffers
        if len(tensors) != len(buffers):
            raise ConfigError(f"staging: {len(tensors)} tensors for {len(buffers)} buffers")
        self._layout = layout
        self._views: dict[str, torch.Tensor] = {}
        for buf, t in zip(buffers, tensors, strict=True):
            self._views[buf.name] = dense_bytes(t, buf.nbytes, buf.name)

    @property
    def layout(self) -> SideLayout:
        """The side's layout (buffers in positional order)."""
        return self._layout

    def buffer_view(self, buf: BufferLayout) -> torch.Tensor:
        """The buffer's bytes as a flat ``uint8`` tensor sharing the engine's memory."""
        return self._views[buf.name]


def dense_bytes(t: torch.Tensor, nbytes: int, name: str) -> torch.Tensor:
    """``t``'s memory as a flat ``uint8`` view (no copy) when its elements fill exactly
    ``nbytes`` dense bytes in some dimension order (a permuted layout is fine: staging
    moves whole rows and never looks inside one).

    Raises:
        ConfigError: ``t`` is not ``nbytes`` dense bytes.
    """
    import torch

    size = t.numel() * t.element_size()
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: t.stride(d))
    step = 1
    for d in dims:
        if t.stride(d) != step:
            raise ConfigError(f"staging: {name}: tensor of shape {tuple(t.shape)} strides "
                              f"{t.stride()} is not dense (gaps or overlaps in its memory)")
        step *= t.shape[d]
    if size != nbytes:
        raise ConfigError(f"staging: {name}: tensor of {size} bytes, the layout's buffer "
                          f"has {nbytes}")
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    flat.set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))
    return flat.view(torch.uint8)


def staging_config(config: SideConfig, *, requests: int, tokens: int | None = None
                   ) -> SideConfig:
    """The config of a staging buffer for ``config``'s KV: the same buffers (names,
    item lengths, kinds), room for ``requests`` requests of up to ``tokens`` tokens
    each (default: the config's ``max_context_len``); in a paged pool without metadata
    rows (vLLM's) more shorter requests share those pages, up to the engine's requests
    in flight (``num_req_slots``).

    The handshake lets each side size its own pools (request slots, blocks), so the
    daemons compare the staging layout with the peer's as they compare any two.
    """
    if requests < 1:
        raise ConfigError(f"staging: requests must be at least 1 (got {requests})")

    def resize(spec: PoolSpec) -> PoolSpec:
        want = tokens if tokens is not None else spec.max_context_len
        if want < 1:
            raise ConfigError(f"staging: tokens must be at least 1 (got {want})")
        if spec.kind in PAGED_KINDS:
            # One pool of pages every request draws from: requests x pages per request.
            # More shorter requests fit in as many pages, so the requests in flight stay
            # the engine's (the daemon's request slots), unless a metadata row per
            # request (sglang's) bounds them anyway.
            pages = requests * -(-want // spec.page_size)
            out = dataclasses.replace(spec, num_req_slots=requests if spec.aux_rows
                                      else spec.num_req_slots,
                                      max_context_len=pages * spec.page_size,
                                      aux_rows=requests if spec.aux_rows else 0)
        else:
            out = dataclasses.replace(spec, num_req_slots=requests, max_context_len=want)
        out.validate("staging")
        return out

    return dataclasses.replace(config, target=resize(config.target),
                               draft=resize(config.draft) if config.draft else None,
                               source=f"staging for {config.source}")


@dataclass
class StagingMetrics:
    """What a staging buffer did (cumulative), and how full it is now."""

    requests_out: int = 0
    requests_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    #: Seconds the gathers / scatters took (device time on CUDA, wall time on CPU),
    #: counted when their copy was waited for.
    copy_out_s: float = 0.0
    copy_in_s: float = 0.0
    #: Requests that waited for room, and those refused after their wait.
    waits: int = 0
    refusals: int = 0
    #: Requests holding staging items, and the fullest kind's share held (0..1).
    held: int = 0
    occupancy: float = 0.0
    #: Requests queued for room now (:meth:`StagingBuffer.queue`).
    waiting: int = 0


class Copy:
    """A gather or scatter issued by a :class:`StagingBuffer`; :meth:`wait` before the
    bytes are used (on CPU it is complete when returned)."""

    def __init__(self, done: Any, start: Any, started: float,
                 account: Any) -> None:
        self._done = done  # a torch.cuda.Event, or None (synchronous copy, complete)
        self._start = start
        self._started = started
        self._account = account  # called once with the copy's seconds
        self._waited = False
        if done is None:
            self._finish(time.perf_counter() - started)

    def done(self) -> bool:
        """True once the copy completed (never blocks)."""
        return self._done is None or bool(self._done.query())

    def wait(self) -> None:
        """Block until the copy completed."""
        if self._done is None or self._waited:
            return
        self._done.synchronize()
        self._finish(self._start.elapsed_time(self._done) / 1e3)

    def _finish(self, seconds: float) -> None:
        self._waited = True
        account, self._account = self._account, None
        if account is not None:
            account(seconds)


@dataclass
class Staged:
    """One request's items in a staging buffer: the lists to send or reserve with
    (``lists``), its bytes, and the copy that filled them (prefill; decode: done)."""

    slots: Slots
    nbytes: int
    copy: Copy | None = None
    released: bool = False

    @property
    def lists(self) -> dict[IndexKind, npt.NDArray[np.int64]]:
        """Staging index lists by kind: what ``send`` / ``send_metadata`` take."""
        return self.slots.lists

    def named_lists(self) -> dict[str, list[int]]:
        """The same lists keyed by kind name (``{"KV_PAGES": [...], ...}``)."""
        return {kind.value: arr.tolist() for kind, arr in self.lists.items()}


@dataclass(frozen=True)
class _Pair:
    """One buffer of the staging layout and its position in the device layout."""

    index: int
    staging: BufferLayout


class StagingBuffer:
    """A host staging buffer for an engine whose KV lives in ``device`` memory.

    Args:
        config: the engine's side config (its device KV's layout).
        device: where the KV lives (``cuda``, ``cuda:1``, ``cpu``): CUDA pins the
            buffer and copies on a side stream; CPU copies synchronously.
        requests / tokens: capacity (:func:`staging_config`).
        wait_s: how long a request waits for room before :class:`StagingFull`.
        policy: what the engine does then (carried by the error).
        clock: what that wait is measured on (:class:`SlotAllocator`'s; a test's fake).
    """

    def __init__(self, config: SideConfig, *, device: str = "cpu", requests: int = 4,
                 tokens: int | None = None, wait_s: float = 5.0,
                 policy: FullPolicy = FullPolicy.FAIL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.device = str(device)
        self.on_cuda = self.device.partition(":")[0] == "cuda"
        self.device_layout = build_side_layout(config)
        self.config = staging_config(config, requests=requests, tokens=tokens)
        self.wait_s = wait_s
        self.pools = EnginePools(self.config)
        self.layout = self.pools.layout
        self._pinned: PinnedHost | None = None
        self._stream: Any = None
        self._lock = threading.Lock()
        self._metrics = StagingMetrics()
        #: Device layouts already checked against the staging layout (by identity).
        self._checked: dict[int, tuple[SideLayout, dict[IndexKind, int]]] = {}
        try:
            self._pairs = _pair_layouts(self.layout, self.device_layout)
            self._kinds = sorted({p.staging.index_kind for p in self._pairs},
                                 key=lambda k: k.value)
            self._slots = SlotAllocator(_capacity(self.layout), policy, clock)
            self._views = [self._rows(p.staging) for p in self._pairs]
            if self.on_cuda:
                import torch

                from kvbeam.engine.pinning import PinnedHost

                self._pinned = PinnedHost([self.pools.allocation_view(i)
                                           for i in range(len(self.layout.tensors))])
                self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        except BaseException:
            self.close()
            raise
        log.info("staging buffer for %s on %s: %.1f MiB in %d memfd(s), %d request(s), "
                 "policy %s", config.model, self.device, self.layout.total_bytes / 2**20,
                 len(self.layout.tensors), requests, policy.value)

    # ---- per request ---------------------------------------------------------------
    def stage_out(self, device_kv: KVMemory, blocks: DeviceLists,
                  wait_s: float | None = None, *, slots: Slots | None = None) -> Staged:
        """Gather a request's device items into free staging items (prefill).

        Returns at once with the copy issued (on CUDA after the current stream's work);
        send ``Staged.lists`` only after ``Staged.copy.wait()``. Raises
        :class:`~kvbeam.errors.StagingFull` when no room came within the wait.
        ``slots``: items :meth:`poll_room` granted for these lists (no wait then); they
        are the request's from here on (given back on an error, like acquired ones).
        """
        try:
            device_lists = self._device_lists(device_kv, blocks)
        except BaseException:
            if slots is not None:
                self._slots.release(slots)
            raise
        slots = self._take(device_lists, wait_s, slots)
        try:
            nbytes = self._bytes(device_lists)
            copy = self._copy(device_kv, device_lists, slots, out=True, nbytes=nbytes)
        except BaseException:
            self._slots.release(slots)
            raise
        return Staged(slots, nbytes, copy)

    def gather_buffers(self, staged: Staged, device_kv: KVMemory, blocks: DeviceLists,
                       buffers: Collection[int], *, first: bool) -> Copy:
        """Gather only the device buffers ``buffers`` (positions in the device layout's
        flat buffers: one layer's, for an engine that sends layer by layer) of a
        request's items into the staging items ``staged`` holds (taken with
        :meth:`reserve` for the same lists). Issued as :meth:`stage_out`'s gather (on
        CUDA after the current stream's work, in order on the side stream, so the
        request's latest copy completing means every earlier one did: it is the one
        :meth:`release` waits for). ``first``: count the request in the metrics (its
        first layer)."""
        device_lists = self._device_lists(device_kv, blocks)
        only = frozenset(buffers)
        nbytes = sum(len(device_lists[p.staging.index_kind]) * p.staging.item_len
                     for p in self._pairs if p.index in only)
        copy = self._copy(device_kv, device_lists, staged.slots, out=True, nbytes=nbytes,
                          only=only, count=first)
        staged.copy = copy
        return copy

    def reserve(self, blocks: DeviceLists, wait_s: float | None = None, *,
                slots: Slots | None = None) -> Staged:
        """Staging items for a request that will land here (decode): one per item of
        its device lists. Raises StagingFull like :meth:`stage_out`; ``slots`` as
        there."""
        lists = self._lists(blocks)
        slots = self._take(lists, wait_s, slots)
        return Staged(slots, self._bytes(lists))

    def queue(self, blocks: DeviceLists, wait_s: float | None = None) -> Ticket:
        """A place in the queue for room for a request of these lists, for an engine
        loop that must not block: ask :meth:`poll_room` at each step, give it up with
        :meth:`cancel`. Raises StagingFull at once when it can never fit."""
        counts = {k: len(v) for k, v in self._lists(blocks).items()}
        return self._slots.enqueue(counts, self.wait_s if wait_s is None else wait_s)

    def poll_room(self, ticket: Ticket) -> Slots | None:
        """The ticket's staging items once granted (None: still waiting; never blocks);
        pass them to :meth:`stage_out` or :meth:`reserve`. Raises StagingFull once its
        wait ran out."""
        return self._slots.poll(ticket)

    def cancel(self, ticket: Ticket) -> None:
        """Give up a ticket whose request ended while it waited (granted items back)."""
        self._slots.cancel(ticket)

    def stage_in(self, staged: Staged, device_kv: KVMemory, blocks: DeviceLists) -> Copy:
        """Scatter a landed request's staging items into its device items (decode,
        after Success); wait for the returned copy before the engine uses the KV."""
        device_lists = self._device_lists(device_kv, blocks)
        for kind, arr in device_lists.items():
            have = sum(n for _, n in staged.slots.extents.get(kind, ()))
            if have != len(arr):
                raise PlanError(f"staging: {kind.value}: {len(arr)} device items, "
                                f"{have} staged")
        return self._copy(device_kv, device_lists, staged.slots, out=False,
                          nbytes=self._bytes(device_lists))

    def release(self, staged: Staged) -> None:
        """Give a request's staging items back (after its send or landing ended).
        Waits for its copy first: the items must not be reused under it."""
        if staged.released:
            return
        if staged.copy is not None:
            staged.copy.wait()
        staged.released = True
        self._slots.release(staged.slots)

    # ---- state -----------------------------------------------------------------------
    @property
    def metrics(self) -> StagingMetrics:
        """A snapshot of the counters and the occupancy now."""
        with self._lock:
            m = dataclasses.replace(self._metrics)
        m.waits, m.refusals = self._slots.waits, self._slots.refusals
        m.held, m.occupancy = self._slots.held, self._slots.occupancy()
        m.waiting = self._slots.waiting
        return m

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked for CUDA (0 on CPU and after close)."""
        return self._pinned.nbytes if self._pinned is not None else 0

    def close(self) -> None:
        """Unpin and free the buffer (detach it from the daemon first)."""
        if self._stream is not None:
            self._stream.synchronize()
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        self._views = []
        self.pools.close()

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------
    def _rows(self, buf: BufferLayout) -> torch.Tensor:
        return self.pools.buffer_view(buf).view(-1, buf.item_len)

    def _take(self, lists: Mapping[IndexKind, npt.NDArray[np.int64]], wait_s: float | None,
              slots: Slots | None) -> Slots:
        """``slots`` checked against the lists' lengths, or items acquired for them."""
        counts = {k: len(v) for k, v in lists.items()}
        if slots is None:
            return self._slots.acquire(counts, self.wait_s if wait_s is None else wait_s)
        have = {k: sum(n for _, n in slots.extents.get(k, ())) for k in counts}
        if have != counts:
            self._slots.release(slots)
            raise PlanError(f"staging: the granted items {have} are not the lists' "
                            f"lengths {counts}")
        return slots

    def _lists(self, blocks: DeviceLists) -> dict[IndexKind, npt.NDArray[np.int64]]:
        """The request's lists of the layout's kinds (others are ignored) as arrays."""
        out = {}
        for kind in self._kinds:
            if kind not in blocks:
                raise PlanError(f"staging: no {kind.value} list (the layout's kinds are "
                                f"{', '.join(k.value for k in self._kinds)})")
            out[kind] = np.asarray(blocks[kind], dtype=np.int64).reshape(-1)
        return out

    def _device_lists(self, device_kv: KVMemory, blocks: DeviceLists
                      ) -> dict[IndexKind, npt.NDArray[np.int64]]:
        """:meth:`_lists`, each index checked against the device buffers' items (a bad
        index on a GPU would end the CUDA context, not raise)."""
        items = self._device_items(device_kv.layout)
        out = self._lists(blocks)
        for kind, arr in out.items():
            if len(arr):
                lo, hi = int(arr.min()), int(arr.max())
                if lo < 0 or hi >= items[kind]:
                    raise PlanError(f"staging: {kind.value} index {lo if lo < 0 else hi} "
                                    f"outside the device buffers' 0..{items[kind] - 1}")
        return out

    def _device_items(self, layout: SideLayout) -> dict[IndexKind, int]:
        """Items per kind of a device layout, checked once against the staging layout."""
        with self._lock:
            hit = self._checked.get(id(layout))
        if hit is not None and hit[0] is layout:
            return hit[1]
        _pair_layouts(self.layout, layout)  # same buffers, else ConfigError
        items = _capacity(layout)
        with self._lock:
            self._checked[id(layout)] = (layout, items)
        return items

    def _bytes(self, lists: Mapping[IndexKind, npt.NDArray[np.int64]]) -> int:
        return sum(len(lists[p.staging.index_kind]) * p.staging.item_len for p in self._pairs)

    def _copy(self, device_kv: KVMemory, lists: Mapping[IndexKind, npt.NDArray[np.int64]],
              slots: Slots, *, out: bool, nbytes: int, only: frozenset[int] | None = None,
              count: bool = True) -> Copy:
        """Copy the request's items between the device KV and its staging items (``out``:
        a gather); ``only``: those device buffers alone; ``count``: one more request in
        the metrics (its bytes are always counted)."""
        import torch

        flat = device_kv.layout.flat_buffers
        started = time.perf_counter()
        requests = 1 if count else 0

        def account(seconds: float) -> None:
            with self._lock:
                m = self._metrics
                if out:
                    m.requests_out += requests
                    m.bytes_out += nbytes
                    m.copy_out_s += seconds
                else:
                    m.requests_in += requests
                    m.bytes_in += nbytes
                    m.copy_in_s += seconds

        pairs = [(pair, host) for pair, host in zip(self._pairs, self._views, strict=True)
                 if only is None or pair.index in only]
        if not self.on_cuda:
            for pair, host in pairs:
                dev = device_kv.buffer_view(flat[pair.index]).view(-1, pair.staging.item_len)
                kind = pair.staging.index_kind
                _cpu_copy(dev, host, lists[kind], slots.extents.get(kind, ()), out)
            return Copy(None, None, started, account)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            idx = {k: torch.as_tensor(v, device=self.device) for k, v in lists.items()}
            for pair, host in pairs:
                dev = device_kv.buffer_view(flat[pair.index]).view(-1, pair.staging.item_len)
                kind = pair.staging.index_kind
                if dev.is_cuda:
                    _cuda_copy(dev, host, idx[kind], slots.extents.get(kind, ()), out)
                else:  # a host buffer beside the device's (sglang's metadata rows)
                    _cpu_copy(dev, host, lists[kind], slots.extents.get(kind, ()), out)
            done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            done.record(stream)
        return Copy(done, start, started, account)


class StagedRequest:
    """One request's way through a staging buffer, for an engine loop that must not
    block (vLLM's worker steps, sglang's scheduler polls): each call moves it as far as
    it goes now and returns.

    Prefill: :meth:`gather` until it returns the staged items (room came and the gather
    completed), then send their ``lists``. Decode: :meth:`reserve` until it returns the
    staged items, reserve with their ``lists``; after Success :meth:`scatter` until
    True, then tell the engine the KV is loaded. :meth:`release` at every end of the
    request (idempotent). A wait for room that ran out raises
    :class:`~kvbeam.errors.StagingFull` (at once, when the request can never fit).
    """

    def __init__(self, buffer: StagingBuffer, blocks: DeviceLists,
                 wait_s: float | None = None) -> None:
        self.buffer = buffer
        self.blocks = blocks
        self.ticket: Ticket | None = buffer.queue(blocks, wait_s)
        self.staged: Staged | None = None
        self._scatter: Copy | None = None

    def gather(self, device_kv: KVMemory) -> Staged | None:
        """Prefill: the staged items once room came and the gather completed (None: not
        yet; the gather is issued the call room comes)."""
        if self.staged is None:
            slots = self._room()
            if slots is None:
                return None
            self.staged = self.buffer.stage_out(device_kv, self.blocks, slots=slots)
        copy = self.staged.copy
        if copy is not None and not copy.done():
            return None
        if copy is not None:
            copy.wait()  # complete: accounts its time
        return self.staged

    def gather_buffers(self, device_kv: KVMemory, buffers: Collection[int], *,
                       first: bool) -> Copy:
        """Prefill layer by layer: gather the device buffers ``buffers`` (a layer's)
        into the items :meth:`reserve` took (:meth:`StagingBuffer.gather_buffers`)."""
        if self.staged is None:
            raise PlanError("staging: a layer's gather before the request's items were "
                            "reserved")
        return self.buffer.gather_buffers(self.staged, device_kv, self.blocks, buffers,
                                          first=first)

    def reserve(self) -> Staged | None:
        """Decode, and prefill layer by layer: the staging items to land in (to gather
        into), once room came (None: not yet)."""
        if self.staged is None:
            slots = self._room()
            if slots is None:
                return None
            self.staged = self.buffer.reserve(self.blocks, slots=slots)
        return self.staged

    @property
    def scattering(self) -> bool:
        """True once :meth:`scatter` issued the copy."""
        return self._scatter is not None

    def scatter(self, device_kv: KVMemory) -> bool:
        """Decode after Success: the landed items into the device KV (issued once); True
        once complete."""
        if self.staged is None:
            raise PlanError("staging: scatter before the request's items were reserved")
        if self._scatter is None:
            self._scatter = self.buffer.stage_in(self.staged, device_kv, self.blocks)
        if not self._scatter.done():
            return False
        self._scatter.wait()
        return True

    def release(self) -> None:
        """The request ended: its place in the queue and its items back."""
        if self.ticket is not None:
            ticket, self.ticket = self.ticket, None
            self.buffer.cancel(ticket)
        if self._scatter is not None:
            self._scatter.wait()  # the items must not be reused under it
        if self.staged is not None:
            self.buffer.release(self.staged)

    def _room(self) -> Slots | None:
        if self.ticket is None:
            raise PlanError("staging: the request's items were released")
        try:
            slots = self.buffer.poll_room(self.ticket)
        except BaseException:
            self.ticket = None  # out of the queue
            raise
        if slots is not None:
            self.ticket = None
        return slots


#: Below this many bytes per contiguous run, a CPU copy goes through one numpy fancy-index
#: call instead of a slice copy per run (a Python iteration per run costs about 1 us).
_RUN_BYTES = 16 << 10


def _cpu_copy(dev: torch.Tensor, host: torch.Tensor, idx: npt.NDArray[np.int64],
              extents: tuple[tuple[int, int], ...], out: bool) -> None:
    """Rows ``idx`` of ``dev`` to / from the staging rows of ``extents`` (in order).

    numpy, on the calling thread: torch's CPU gather and scatter run on its intra-op
    pool, whose threads spin and wait for each other when the engine's cores are busy
    (measured on the 2-core test host: 4-7x a plain copy of the bytes, against about
    1x here). Rows contiguous on both sides are copied as one slice.
    """
    d, h = dev.numpy(), host.numpy()
    item = d.shape[1]
    pos = 0
    for start, n in extents:
        part = idx[pos:pos + n]
        brk = np.flatnonzero(np.diff(part) != 1) + 1
        if len(brk) + 1 > n * item // _RUN_BYTES:  # many short runs: one numpy call
            if out:
                np.take(d, part, axis=0, out=h[start:start + n])
            else:
                d[part] = h[start:start + n]
        else:
            lo = np.concatenate(([0], brk)).tolist()
            hi = np.concatenate((brk, [n])).tolist()
            for a, b in zip(lo, hi, strict=True):
                first = int(part[a])
                if out:
                    h[start + a:start + b] = d[first:first + b - a]
                else:
                    d[first:first + b - a] = h[start + a:start + b]
        pos += n


def _cuda_copy(dev: torch.Tensor, host: torch.Tensor, idx: torch.Tensor,
               extents: tuple[tuple[int, int], ...], out: bool) -> None:
    """As :func:`_cpu_copy` on the current (side) stream: one gather or scatter kernel on
    the device into / from a contiguous temporary, one DMA per extent."""
    import torch

    if not len(idx):
        return
    if out:
        tmp = torch.index_select(dev, 0, idx)
        pos = 0
        for start, n in extents:
            host[start:start + n].copy_(tmp[pos:pos + n], non_blocking=True)
            pos += n
        return
    tmp = torch.empty((len(idx), dev.shape[1]), dtype=dev.dtype, device=dev.device)
    pos = 0
    for start, n in extents:
        tmp[pos:pos + n].copy_(host[start:start + n], non_blocking=True)
        pos += n
    dev.index_copy_(0, idx, tmp)


def _pair_layouts(staging: SideLayout, device: SideLayout) -> list[_Pair]:
    """Each staging buffer with its device twin: same position, name, item length and
    kind (the capacities differ); ConfigError naming the first that differs."""
    s_bufs, d_bufs = staging.flat_buffers, device.flat_buffers
    if len(s_bufs) != len(d_bufs):
        raise ConfigError(f"staging: the device KV has {len(d_bufs)} buffers, the staging "
                          f"layout {len(s_bufs)}")
    pairs = []
    for i, (s, d) in enumerate(zip(s_bufs, d_bufs, strict=True)):
        if (s.name, s.item_len, s.index_kind) != (d.name, d.item_len, d.index_kind):
            raise ConfigError(f"staging: buffer {i}: device {d.name} ({d.item_len}-byte "
                              f"{d.index_kind.value} items) against staging {s.name} "
                              f"({s.item_len}-byte {s.index_kind.value} items)")
        pairs.append(_Pair(i, s))
    return pairs


def _capacity(layout: SideLayout) -> dict[IndexKind, int]:
    """Items of each kind every buffer of that kind holds (the smallest buffer's)."""
    out: dict[IndexKind, int] = {}
    for b in layout.flat_buffers:
        out[b.index_kind] = min(out.get(b.index_kind, b.items), b.items)
    return out
