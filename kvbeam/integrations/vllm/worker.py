"""The connector's worker side: vLLM's KV cache attached (shared or staged); transfers.

Runs in vLLM's worker process. :meth:`WorkerSide.register_kv_caches` moves the one
allocation vLLM's per-layer views share into a memfd (every view is re-pointed in
place, so vLLM's attention layers keep using the same tensor objects) and attaches it
to the local ``--pools engine`` daemon as a paged pool: one buffer per layer, one
item per block. Every per-request call goes over that attachment's engine channel
(:mod:`kvbeam.engine.channel`): the step's reservations and sends leave in one write
(:meth:`WorkerSide.absorb`), and :meth:`WorkerSide.get_finished` reads the states the
daemon pushed (no RPC per step). The daemons move the bytes.

Staged (a KV cache on a GPU, or ``staging: true``; :mod:`~kvbeam.integrations.vllm.staged`):
the cache stays where vLLM put it and the worker attaches a host staging buffer of the
same geometry instead (:class:`~kvbeam.engine.staging.StagingBuffer`). Prefill gathers
a finished request's blocks into staging items (on CUDA on a side stream during the
step) and sends from them once the copy completed (layer by layer, ``layerwise``: it
takes the staging items at the prompt's last step and gathers each layer as vLLM
computes it, giving the daemon the layers whose gathers completed, never waiting in
the forward); decode reserves staging items,
and after Success scatters them into vLLM's blocks before it reports the load done.
A full buffer makes a request wait at most ``staging_wait_s``, asked again at each
step (vLLM's step never blocks on it); then prefill's send fails (decode computes or
fails the request by its policy) and decode's load fails as a load error, declined to
prefill at once. Staging items go back at every end of a request.

With tensor parallelism every rank's worker runs its own WorkerSide, attached to its own
daemon (``Settings.attach_sockets[rank]``) with its share of the heads (the pool's
``tp_rank``/``tp_size``). Prefill rank p sends one transfer to each decode rank whose
heads it holds (staged: all of them from the same staging items); decode rank d
reserves its own at the prefill rank holding its heads
(:func:`~kvbeam.integrations.vllm.params.rank_transfer_id`). vLLM counts a request sent
or received once every rank reported it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvbeam.engine import (
    Attachment,
    EngineBuffers,
    EnginePools,
    KVPoll,
    Receiver,
    Sender,
    SharedMemory,
    StagingBuffer,
    attach,
)
from kvbeam.engine.staging import Copy, Staged, StagedRequest, TensorKV, dense_bytes
from kvbeam.engine.staging_slots import FullPolicy
from kvbeam.errors import ConfigError, KvbeamError, StagingFull
from kvbeam.integrations.vllm.params import (
    Settings,
    decode_ranks_of,
    prefill_rank_of,
    rank_transfer_id,
)
from kvbeam.integrations.vllm.scheduler import Load, Push, StepPlan, WorkerReport
from kvbeam.integrations.vllm.staged import StagingReport, stages
from kvbeam.pools.engine_indices import ListLike
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.proto.attach_codec import BufferRef
from kvbeam.states import FailureReason

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A send failed for this: the pair's handshake was refused, which a restart of either
#: side does not change (the scheduler side stops returning do_remote_prefill for that
#: decode daemon for a while). An unreachable daemon is not held against it: it may be
#: back at the next request (restarted, its engine re-attached).
_PAIR_FAILED = frozenset({FailureReason.INCOMPATIBLE})
KV = IndexKind.KV_PAGES
#: The counted reason of a request whose staging wait ran out (or that never fits).
STAGING_FULL = "staging_full"


class Geometry(NamedTuple):
    """A layer's KV block geometry, as the daemons' handshake compares it."""

    num_kv_heads: int
    block_size: int
    head_size: int
    inner_layout: str


_TORCH_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.float32": "float32", "torch.uint8": "uint8",
                 "torch.float8_e4m3fn": "float8_e4m3fn"}


@dataclass
class _Loading:
    """A decode request whose KV lands here: waiting for staging room (``staged``),
    reserved (``receiver``), or failed before it was reserved (``failure``: the counted
    reason and why)."""

    load: Load
    receiver: Receiver | None = None
    staged: StagedRequest | None = None
    failure: tuple[str, str] | None = None


@dataclass
class _Sending:
    """A prefill request's send: waiting for staging room or its gather (``staged``),
    sent (``senders``: one per decode rank this rank covers), or failed before it was
    sent (``failure``)."""

    push: Push
    staged: StagedRequest | None = None
    senders: list[Sender] = field(default_factory=list)
    sent: bool = False
    failure: tuple[str, str] | None = None
    #: Layer by layer: the layers given so far (0: none, nor its blocks yet), and
    #: whether vLLM still runs the request (its end is not reported before vLLM's
    #: own: vLLM frees the blocks of a send reported ended).
    layers_sent: int = 0
    running: bool = False
    #: Staged layer by layer: the layers whose gather is issued, and each gather not
    #: yet given to the daemon, in order: (its copy, the layers ready once it completed).
    layers_gathered: int = 0
    copies: deque[tuple[Copy, int]] = field(default_factory=deque)


class WorkerSide:
    """One worker's attached KV cache and the transfers it waits on."""

    def __init__(self, settings: Settings, block_size: int, num_kv_heads: int,
                 head_size: int, tp_rank: int = 0, tp_size: int = 1, *,
                 kv_buffer_device: str = "", max_model_len: int = 0,
                 load_failure_policy: str = "fail") -> None:
        """``num_kv_heads``: this rank's own heads; ``tp_rank`` of ``tp_size``: its place;
        ``kv_buffer_device``, ``max_model_len``, ``load_failure_policy``: vLLM's (the
        staging decision, the staging buffer's default request length, what a full
        buffer's refusal says decode does).

        Raises:
            ConfigError: the settings do not name one daemon per TP rank.
        """
        settings.check_tp(tp_size)
        self.settings = settings
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.kv_buffer_device = kv_buffer_device
        self.max_model_len = max_model_len
        self.load_failure_policy = load_failure_policy
        self.attach_socket = settings.attach_sockets[tp_rank]
        self.attachment: Attachment | None = None
        self._shared = SharedMemory()
        self._views: list[torch.Tensor] = []
        #: Staged: the buffer the daemon maps, and vLLM's cache as its device KV.
        self.staging: StagingBuffer | None = None
        self._device_kv: TensorKV | None = None
        self._staging_report = StagingReport()
        self._loads: dict[str, _Loading] = {}
        self._sends: dict[str, _Sending] = {}
        #: Layer by layer: each attached layer's position (vLLM's layer name -> layer),
        #: and the step's streamed sends, until their last layer went.
        self._layer_of: dict[str, int] = {}
        self._streaming: list[_Sending] = []
        #: Staged streams whose last layers' gathers were still running at the end of
        #: the forward: given to the daemon as each completes (:meth:`_advance`).
        self._draining: list[_Sending] = []
        #: Cancelled requests this rank never streamed (a staged cache): ended at once.
        self._nothing_sent: set[str] = set()
        self._load_errors: set[int] = set()
        self.moved_bytes = 0
        #: Failed sends and loads since :meth:`take_counts` (vLLM's connector stats).
        self.counts: Counter[str] = Counter()
        #: Decode daemons a send to which could not happen since the last report.
        self._refused: dict[str, str] = {}
        self._reported_detached = ""

    # ---- memory ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's KV cache from its live tensors, then attach it: shared (moved
        into a memfd) or staged (a host staging buffer of its geometry)."""
        views = list(kv_caches.values())
        # Every field the daemons' handshake compares is read from the live cache (its
        # tensor's dtype, shape and strides), and checked against vLLM's config.
        dtype = _TORCH_DTYPES.get(str(views[0].dtype))
        if dtype is None:
            raise KvbeamError(f"KV dtype {views[0].dtype} has no kvbeam name")
        num_blocks = int(views[0].shape[0])
        live = self._live_geometry(next(iter(kv_caches)), views[0])
        spec = paged_spec(num_layers=len(views), block_size=live.block_size,
                          num_kv_heads=live.num_kv_heads, head_size=live.head_size,
                          dtype=dtype, inner_layout=live.inner_layout, num_blocks=num_blocks,
                          tp_rank=self.tp_rank, tp_size=self.tp_size)
        item = block_bytes(spec)
        for name, v in kv_caches.items():
            per_block = v.stride(0) * v.element_size()
            if int(v.shape[0]) != num_blocks or per_block != item:
                raise KvbeamError(f"layer {name}: view {tuple(v.shape)} strides {v.stride()} "
                                  f"is not {num_blocks} contiguous blocks of {item} bytes")
            try:
                dense_bytes(v, num_blocks * item, f"layer {name}")
            except ConfigError as exc:
                raise KvbeamError(f"layer {name}: view {tuple(v.shape)} strides "
                                  f"{v.stride()} is not {num_blocks} contiguous blocks of "
                                  f"{item} bytes ({exc})") from exc
        config = paged_side_config(self.settings.model, spec)
        device = str(views[0].device)
        staged = stages(device, self.settings.staging, self.kv_buffer_device)
        pools = self._stage(config, views, device) if staged else None
        buffers = None if staged else self._share(views, num_blocks, item)
        self._views = views
        self._layer_of = {name: i for i, name in enumerate(kv_caches)}
        # Only a request's end is pushed: get_finished acts on nothing else, and each
        # push would wake the channel's reader thread inside vLLM's worker. A restarted
        # daemon gets the same memory again (reattach); meanwhile new loads and sends
        # fail at once (their channel reads closed), so vLLM recomputes or errors as its
        # kv_load_failure_policy says, and absorb() reads the new channel once back.
        if pools is not None:
            self.attachment = attach(self.attach_socket, pools, pushes="final",
                                     reattach=True)
        else:
            assert buffers is not None
            self.attachment = attach(self.attach_socket, buffers, config, pushes="final",
                                     reattach=True)
        log.info("attached vLLM's KV cache (TP rank %d of %d%s): %d layers x %d blocks of %d "
                 "bytes (%s, %d KV heads x %d tokens x head size %d, layout %s) to %s",
                 self.tp_rank, self.tp_size, f", on {device}, staged" if staged else "",
                 len(views), num_blocks, item, dtype, live.num_kv_heads, live.block_size,
                 live.head_size, live.inner_layout, self.attach_socket)

    def _share(self, views: list[torch.Tensor], num_blocks: int, item: int) -> EngineBuffers:
        """vLLM's one allocation moved into a memfd, every view re-pointed in place (vLLM's
        layers hold these tensor objects); its attach description."""
        import torch

        storage = views[0].untyped_storage()
        if any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
            raise KvbeamError("vLLM's KV views do not share one allocation")
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        shared = self._shared.share(whole, "vllm-kv")
        for v in views:
            v.set_(shared.untyped_storage(), v.storage_offset(), v.size(), v.stride())
        refs = [BufferRef(0, int(v.storage_offset()) * v.element_size(), num_blocks * item, item)
                for v in views]
        return EngineBuffers(list(self._shared.fds), [refs])

    def _stage(self, config: SideConfig, views: list[torch.Tensor], device: str
               ) -> EnginePools:
        """The staging buffer for vLLM's cache (which stays where it is); its pools."""
        setting = self.settings.staging
        policy = FullPolicy(self.load_failure_policy if self.load_failure_policy in
                            ("fail", "recompute") else "fail")
        self._device_kv = TensorKV(build_side_layout(config), views)
        self.staging = StagingBuffer(config, device=device, requests=setting.requests,
                                     tokens=setting.tokens or self.max_model_len or None,
                                     wait_s=setting.wait_s, policy=policy)
        return self.staging.pools

    def _live_geometry(self, name: str, view: torch.Tensor) -> Geometry:
        """The block geometry of one layer's live KV view, vLLM's logical ``[B, H, N, C]``
        (C: K and V of one head for one token), and its layout from the strides (vLLM
        CPU: ``LBHNC``). Each must equal what vLLM's config says (else vLLM built a cache
        kvbeam does not pair: refused, naming both).

        Raises:
            KvbeamError: another shape, or a value that differs from the config.
        """
        shape = tuple(int(d) for d in view.shape)
        if len(shape) != 4 or shape[3] % 2:
            raise KvbeamError(f"layer {name}: KV view of shape {shape}: kvbeam pairs vLLM's "
                              "[blocks, KV heads, tokens, K and V] layer caches only")
        strides = tuple(int(x) for x in view.stride())
        axes = sorted((1, 2, 3), key=lambda d: -strides[d])
        live = Geometry(shape[1], shape[2], shape[3] // 2,
                        "LB" + "".join("HNC"[d - 1] for d in axes))
        want = Geometry(self.num_kv_heads, self.block_size, self.head_size,
                        self.settings.inner_layout or live.inner_layout)
        differ = [f"{f}: cache {getattr(live, f)}, config {getattr(want, f)}"
                  for f in Geometry._fields if getattr(live, f) != getattr(want, f)]
        if differ:
            raise KvbeamError(f"layer {name}: vLLM's live KV cache differs from its config "
                              f"({'; '.join(differ)}): kvbeam describes the cache itself to "
                              "the daemons; fix the config (inner_layout: leave it out)")
        return live

    # ---- transfers ---------------------------------------------------------------
    def absorb(self, plan: StepPlan) -> None:
        """Reserve this step's loads and send its sends, in one write to the daemon
        (staged: those with staging room; the others wait, asked again each step)."""
        att = self.attachment
        channel = att.channel if att is not None else None
        if att is None or channel is None:
            for load in plan.loads:
                self._loads[load.req_id] = _Loading(load, failure=("not_reserved",
                                                                   "not reserved"))
            for push in plan.sends:
                self._sends[push.req_id] = _Sending(push, failure=("detached",
                                                                   "no engine channel"))
            if plan.loads or plan.sends:
                log.warning("no engine channel to the daemon: %d load(s) and %d send(s) fail",
                            len(plan.loads), len(plan.sends))
            return
        with channel.batch():
            for load in plan.loads:
                loading = self._loads[load.req_id] = _Loading(load)
                if load.failed:
                    loading.failure = ("not_reserved", "not reserved")
                elif self.staging is None:
                    self._reserve(att, loading)
                else:
                    self._queue(loading, load.block_ids)
                    self._advance_load(att, loading)
            for declined in plan.declines:
                self._receiver(att, declined.kvbeam_id, declined.prefill_daemons).decline(
                    declined.why)
            for push in plan.streams:
                self._stream(att, push)
            for rid in plan.cancels:
                self._cancel(rid)
            for push in plan.sends:
                streamed = self._sends.get(push.req_id)
                if streamed is not None:  # its layers went as they were computed
                    streamed.running = False
                    continue
                sending = self._sends[push.req_id] = _Sending(push)
                if self.staging is None:
                    self._send(att, sending, None)
                else:
                    self._queue(sending, push.block_ids)
                    self._advance_send(att, sending)

    def _receiver(self, att: Attachment, kvbeam_id: str, prefill_daemons: tuple[str, ...]
                  ) -> Receiver:
        """This rank's share of a load: its own transfer id, at the prefill rank holding
        its heads."""
        prefill = prefill_daemons[prefill_rank_of(self.tp_rank, self.tp_size,
                                                  len(prefill_daemons))]
        return Receiver(att, rank_transfer_id(kvbeam_id, self.tp_rank, self.tp_size), prefill)

    def _reserve(self, att: Attachment, loading: _Loading, blocks: ListLike | None = None
                 ) -> None:
        """Reserve the load at its blocks (staged: at its staging items)."""
        load = loading.load
        loading.receiver = self._receiver(att, load.kvbeam_id, load.prefill_daemons)
        loading.receiver.reserve(list(load.block_ids) if blocks is None else blocks,
                                 seq_len=load.seq_len, kv_skip=load.kv_skip)

    def _senders(self, att: Attachment, push: Push) -> list[Sender]:
        """A sender per decode rank this rank holds heads of (no decode named: this
        rank's share goes to whichever decode daemon reserves its transfer id, a decode
        of this TP size: rank to rank)."""
        if not push.decode_daemons:
            targets = [(rank_transfer_id(push.kvbeam_id, self.tp_rank, self.tp_size), "")]
        else:
            decode_tp = len(push.decode_daemons)
            targets = [(rank_transfer_id(push.kvbeam_id, d, decode_tp), push.decode_daemons[d])
                       for d in decode_ranks_of(self.tp_rank, self.tp_size, decode_tp)]
        return [Sender(att, transfer_id, decode) for transfer_id, decode in targets]

    def _send(self, att: Attachment, sending: _Sending, blocks: ListLike | None) -> None:
        """Send the request's blocks (staged: its staging items) to every decode rank
        this rank holds heads of."""
        push = sending.push
        for sender in self._senders(att, push):
            sender.send(list(push.block_ids) if blocks is None else blocks,
                        seq_len=push.seq_len)
            sending.senders.append(sender)
        sending.sent = True

    # ---- layer by layer ----------------------------------------------------------
    def _stream(self, att: Attachment, push: Push) -> None:
        """A prompt this step's forward ends: its layers go as they are computed
        (:meth:`save_layer`). Staged, its staging items are taken now and each layer is
        gathered into them as it is computed (on CUDA on the side stream), then given;
        a buffer without room at once sends it whole at its end instead."""
        if not self._layer_of:
            return
        staged = None
        if self.staging is not None:
            staged = self._stage_stream(push)
            if staged is None:
                return
        sending = self._sends[push.req_id] = _Sending(push, staged=staged,
                                                      senders=self._senders(att, push),
                                                      running=True)
        self._streaming.append(sending)
        self.counts["streamed"] += 1

    def _stage_stream(self, push: Push) -> StagedRequest | None:
        """Staging items for a prompt streamed layer by layer, when the buffer has room
        now (None: it goes whole at its end, waiting for room as any staged send)."""
        assert self.staging is not None
        try:
            request = StagedRequest(self.staging, {KV: push.block_ids})
        except StagingFull as exc:  # never fits: its whole send says so at its end
            log.debug("request %s: not streamed: %s", push.req_id, exc)
            return None
        try:
            if request.reserve() is not None:
                return request
        except StagingFull as exc:
            log.debug("request %s: not streamed: %s", push.req_id, exc)
        request.release()
        log.debug("request %s: sent whole at its end (no staging room at its last step)",
                  push.req_id)
        return None

    def save_layer(self, layer_name: str) -> None:
        """vLLM wrote this layer's KV for the step: each streamed prompt's blocks are
        ready in the layers up to it (its blocks go with the first layer, the last
        layer's frame is the final one). One write for all of them; nothing waits."""
        layer = self._layer_of.get(layer_name)
        att = self.attachment
        if layer is None or att is None or att.channel is None:
            return
        if not self._streaming and not self._draining:
            return
        with att.channel.batch():
            self._give_drained()
            for sending in list(self._streaming):
                self._layer_ready(sending, layer + 1)
        if layer == len(self._layer_of) - 1:
            self._forward_over()

    def forward_done(self) -> None:
        """The step's forward is over: a streamed prompt whose last layer was not seen
        (a layer name vLLM did not register here) goes final now, every layer written."""
        att = self.attachment
        if att is None or att.channel is None:
            for sending in self._streaming:  # nothing more can go: it ends at vLLM's end
                sending.failure, sending.sent = ("detached", "no engine channel"), True
            self._streaming.clear()
            return
        with att.channel.batch():
            for sending in list(self._streaming):
                self._layer_ready(sending, len(self._layer_of))
        self._forward_over()

    def _forward_over(self) -> None:
        """Every layer of the step was seen: the streams leave the step; a staged one
        whose gathers still run goes on once they completed (:meth:`_advance`)."""
        self._draining += [s for s in self._streaming if s.copies]
        self._streaming.clear()

    def _layer_ready(self, sending: _Sending, layers: int) -> None:
        """The prompt's blocks are ready in ``layers`` layers: tell the daemon (staged:
        gather the new layers first, and tell it once the gather completed)."""
        total = len(self._layer_of)
        if sending.staged is None:
            if layers > sending.layers_sent:
                self._give_layers(sending, layers, final=layers == total)
            return
        if layers > sending.layers_gathered:
            assert self._device_kv is not None
            try:
                copy = sending.staged.gather_buffers(
                    self._device_kv, self._layer_buffers(sending.layers_gathered, layers),
                    first=not sending.layers_gathered)
            except Exception as exc:
                self._stream_failed(sending, exc)
                return
            sending.copies.append((copy, layers))
            sending.layers_gathered = layers
        self._give_gathered(sending)

    def _give_gathered(self, sending: _Sending) -> None:
        """Tell the daemon the layers whose gathers completed (never waits)."""
        ready = 0
        while sending.copies and sending.copies[0][0].done():
            copy, ready = sending.copies.popleft()
            copy.wait()  # complete: accounts its time
        if ready > sending.layers_sent:
            self._give_layers(sending, ready, final=ready == len(self._layer_of))

    def _give_drained(self) -> None:
        """The staged streams whose last gathers completed since: given now."""
        for sending in list(self._draining):
            self._give_gathered(sending)
            if not sending.copies:
                self._draining.remove(sending)

    def _layer_buffers(self, first: int, last: int) -> list[int]:
        """The device layout's KV buffers of layers ``[first, last)`` (flat positions)."""
        assert self._device_kv is not None
        return [i for i, layer in enumerate(self._device_kv.layout.kv_layers)
                if first <= layer < last]

    def _stream_failed(self, sending: _Sending, exc: Exception) -> None:
        """A layer's gather could not be issued: the stream stops. Nothing given yet: the
        prompt goes whole at its end; else its send is aborted (decode computes it)."""
        log.error("request %s: a layer's gather failed (%s): %s", sending.push.req_id,
                  type(exc).__name__, exc)
        if sending in self._streaming:
            self._streaming.remove(sending)
        if not sending.layers_sent:
            self._sends.pop(sending.push.req_id, None)
            if sending.staged is not None:
                sending.staged.release()
            return
        sending.copies.clear()
        sending.failure, sending.sent = ("staging", f"a layer's gather failed: {exc}"), True
        for sender in sending.senders:
            sender.abort("a layer's gather into the staging buffer failed")

    def _give_layers(self, sending: _Sending, layers: int, *, final: bool) -> None:
        """Tell the daemon the prompt's blocks (staged: its staging items) are ready in
        ``layers`` layers (the final frame: in every layer)."""
        push = sending.push
        blocks: ListLike = []
        if not sending.layers_sent:
            staged = sending.staged.staged if sending.staged is not None else None
            blocks = staged.lists[KV] if staged is not None else list(push.block_ids)
        for sender in sending.senders:
            sender.send_chunk(blocks, seq_len=push.seq_len, final=final,
                              layers=None if final else layers)
        sending.layers_sent = layers
        sending.sent = sending.sent or final

    def _cancel(self, req_id: str) -> None:
        """A streamed request ended without a transfer: abort its sends (they end
        Failed once prefill's writes from its blocks drained; then vLLM frees them). One
        that sent nothing (a staged cache's, or no layer yet) ends at once."""
        sending = self._sends.get(req_id)
        if sending is not None and sending in self._draining:
            self._draining.remove(sending)
        if sending is None or not sending.layers_sent:
            self._sends.pop(req_id, None)  # nothing of it went: its blocks are free
            if sending is not None and sending.staged is not None:
                sending.staged.release()  # (after its gathers completed)
            if sending is not None and sending in self._streaming:
                self._streaming.remove(sending)
            self._nothing_sent.add(req_id)
            return
        if sending in self._streaming:
            self._streaming.remove(sending)
        sending.sent, sending.running = True, False  # it ends with its senders' Failed
        for sender in sending.senders:
            sender.abort("vLLM ended the request without a transfer")

    # ---- staged ------------------------------------------------------------------
    def _queue(self, request: _Loading | _Sending, blocks: tuple[int, ...]) -> None:
        """A place in the staging buffer's queue (refused at once: never fits)."""
        assert self.staging is not None
        try:
            request.staged = StagedRequest(self.staging, {KV: blocks})
        except StagingFull as exc:
            request.failure = (STAGING_FULL, str(exc))

    def _advance(self, att: Attachment | None) -> None:
        """Move each staged request on as far as it goes now, never waiting: loads and
        sends whose staging room came, sends whose gather completed (the buffer grants
        room in arrival order)."""
        if self.staging is None or att is None:
            return
        self._give_drained()
        for loading in self._loads.values():
            if loading.receiver is None and loading.failure is None:
                self._advance_load(att, loading)
        for sending in self._sends.values():
            if not sending.sent and sending.failure is None:
                self._advance_send(att, sending)

    def _advance_load(self, att: Attachment, loading: _Loading) -> None:
        """Staging room came: reserve at the staging items. The wait ran out (or the
        request never fits): a load error, declined to prefill at once (it frees its
        blocks)."""
        load = loading.load
        if loading.staged is not None and loading.failure is None:
            try:
                landing = loading.staged.reserve()
            except StagingFull as exc:
                loading.failure = (STAGING_FULL, str(exc))
            else:
                if landing is not None:
                    self._reserve(att, loading, landing.lists[KV])
                return
        if loading.failure is not None:
            self._receiver(att, load.kvbeam_id, load.prefill_daemons).decline(
                f"decode's staging buffer: {loading.failure[1]}")

    def _advance_send(self, att: Attachment, sending: _Sending) -> None:
        """Staging room came: gather the blocks into it (the copy is issued, on CUDA on
        a side stream); the gather completed: send from the staging items. The wait ran
        out: no send."""
        assert self._device_kv is not None
        if sending.staged is None or sending.failure is not None:
            return
        try:
            staged = sending.staged.gather(self._device_kv)
        except StagingFull as exc:
            sending.failure = (STAGING_FULL, str(exc))
            return
        if staged is not None:
            self._send(att, sending, staged.lists[KV])

    # ---- ends --------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(sends ended, loads ended), from the states the daemon pushed; a failed load's
        blocks go to the load errors. Staged requests move on first (room, copies)."""
        with self._batch():
            self._advance(self.attachment)
            sent = {r for r, s in self._sends.items() if self._send_ended(r, s)}
            sent |= self._nothing_sent
            self._nothing_sent = set()
            received = {r for r, lo in self._loads.items() if self._load_ended(r, lo)}
            for r in sent:
                staged = self._sends.pop(r).staged if r in self._sends else None
                if staged is not None:
                    staged.release()
            for r in received:
                staged = self._loads.pop(r).staged
                if staged is not None:
                    staged.release()
            if sent or received:
                self._advance(self.attachment)  # the room they gave back, at once
        return sent, received

    def _send_ended(self, req_id: str, sending: _Sending) -> bool:
        """Whether the send ended (each failure counted and logged once, here)."""
        if sending.running:
            return False
        if sending.failure is not None:
            label, why = sending.failure
            self.counts[f"send_failed_{label}"] += 1
            log.warning("request %s: no send of transfer %s (%s): %s; decode computes the "
                        "prompt or fails it (its kv_load_failure_policy)", req_id,
                        sending.push.kvbeam_id, label, why)
            return True
        if not sending.sent or not all(s.poll() in (KVPoll.Success, KVPoll.Failed)
                                       for s in sending.senders):
            return False
        for sender in sending.senders:
            failed = sender.failure()
            if failed is None:
                continue
            reason, why = failed
            self.counts[f"send_failed_{reason.value if reason else 'unknown'}"] += 1
            log.warning("request %s: send of transfer %s failed (%s): %s; decode computes "
                        "the prompt", req_id, sender.request_id,
                        reason.value if reason else "?", why)
            if sender.decode_address and reason in _PAIR_FAILED:
                self._refused[sender.decode_address] = f"{reason.value}: {why}"
        return True

    def _load_ended(self, req_id: str, loading: _Loading) -> bool:
        """Whether the load ended: landed (staged: scattered into vLLM's blocks, the
        copy complete) or failed (its blocks to the load errors)."""
        load, receiver = loading.load, loading.receiver
        failure = loading.failure
        if failure is None:
            if receiver is None:
                return False  # waiting for staging room
            state = receiver.poll()
            if state is KVPoll.Success:
                if loading.staged is not None and not self._scattered(loading.load,
                                                                      loading.staged):
                    return False
                self._landed(load, receiver)
                return True
            if state is not KVPoll.Failed:
                return False
            failed = receiver.failure()
            failure = ((failed[0].value if failed[0] else "unknown"), failed[1]) if failed \
                else ("unknown", "failed")
        label, why = failure
        self.counts[f"load_failed_{label}"] += 1
        log.warning("request %s: transfer %s failed (%s: %s); vLLM gets its blocks as load "
                    "errors (kv_load_failure_policy)", req_id, load.kvbeam_id, label, why)
        self._load_errors.update(load.block_ids)
        return True

    def _scattered(self, load: Load, staged: StagedRequest) -> bool:
        """Staged decode after Success: the landed staging items scattered into vLLM's
        blocks (issued once; on CUDA on a side stream): True once complete."""
        assert self._device_kv is not None and staged.staged is not None
        if not staged.scattering:
            self._before_scatter(load, staged.staged)
        return staged.scatter(self._device_kv)

    def _before_scatter(self, load: Load, landing: Staged) -> None:
        """Staged decode: the request's bytes are in the staging items, not yet in
        vLLM's blocks (a test's negative control corrupts them here)."""

    def _batch(self) -> contextlib.AbstractContextManager[None]:
        channel = self.attachment.channel if self.attachment is not None else None
        return channel.batch() if channel is not None else contextlib.nullcontext()

    def detached(self) -> str:
        """Why no daemon will take this worker's requests ("": its attachment is up, or
        it is re-attaching: a daemon that went away may be back at the next request,
        and meanwhile a send fails at once and so does decode's reservation)."""
        att = self.attachment
        if att is None:
            return "not attached yet"
        channel = att.channel
        if channel is None:
            return f"the daemon on {self.attach_socket} has no engine channel (an older kvbeam)"
        if channel.closed_reason and getattr(att, "reattaching", False):
            return ""
        return channel.closed_reason

    def report(self) -> WorkerReport | None:
        """What the scheduler side should know since the last report (None: nothing):
        the attachment went or came back, sends to a decode daemon that could not
        happen (vLLM's connector worker metadata carries it to the scheduler)."""
        detached = self.detached()
        changed = detached != self._reported_detached
        if not changed and not self._refused:
            return None
        self._reported_detached = detached
        out = WorkerReport(detached if changed else None, self._refused)
        self._refused = {}
        return out

    def take_counts(self) -> dict[str, float]:
        """Failed sends and loads since the last call, by reason, and (staged) what the
        staging buffer did since (:mod:`~kvbeam.integrations.vllm.staged`); then zero."""
        out: dict[str, float] = dict(self.counts)
        self.counts = Counter()
        if self.staging is not None:
            out.update(self._staging_report.take(self.staging.metrics))
        return out

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def _landed(self, load: Load, receiver: Receiver) -> None:
        self.moved_bytes += len(load.block_ids) * sum(
            v.stride(0) * v.element_size() for v in self._views)
        try:  # the engine took the KV over: decode's daemon frees the reservation
            receiver.release()
        except KvbeamError as exc:
            log.info("transfer %s: release: %s", load.kvbeam_id, exc)

    def close(self) -> None:
        """Detach (the daemon fails what is still moving) and close the memfds (staged:
        unpin and free the staging buffer)."""
        if self.attachment is not None:
            self.attachment.close()
        if self.staging is not None:
            self.staging.close()
        self._shared.close()
