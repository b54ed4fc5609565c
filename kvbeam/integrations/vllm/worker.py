"""The connector's worker side: vLLM's KV cache in shared memory, attached; transfer polling.

Runs in vLLM's worker process. :meth:`WorkerSide.register_kv_caches` moves the one
allocation vLLM's per-layer views share into a memfd (every view is re-pointed in
place, so vLLM's attention layers keep using the same tensor objects) and attaches it
to the local ``--pools engine`` daemon as a paged pool: one buffer per layer, one
item per block. Every per-request call goes over that attachment's engine channel
(:mod:`kvbeam.engine.channel`): the step's reservations and sends leave in one write
(:meth:`WorkerSide.absorb`), and :meth:`WorkerSide.get_finished` reads the states the
daemon pushed (no RPC per step). The daemons move the bytes.

With tensor parallelism every rank's worker runs its own WorkerSide, attached to its own
daemon (``Settings.attach_sockets[rank]``) with its share of the heads (the pool's
``tp_rank``/``tp_size``). Prefill rank p sends one transfer to each decode rank whose
heads it holds; decode rank d reserves its own at the prefill rank holding its heads
(:func:`~kvbeam.integrations.vllm.params.rank_transfer_id`). vLLM counts a request sent
or received once every rank reported it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

from kvbeam.engine import (
    Attachment,
    EngineBuffers,
    KVPoll,
    Receiver,
    Sender,
    SharedMemory,
    attach,
)
from kvbeam.errors import KvbeamError
from kvbeam.integrations.vllm.params import (
    Settings,
    decode_ranks_of,
    prefill_rank_of,
    rank_transfer_id,
)
from kvbeam.integrations.vllm.scheduler import Load, StepPlan, WorkerReport
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
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


class Geometry(NamedTuple):
    """A layer's KV block geometry, as the daemons' handshake compares it."""

    num_kv_heads: int
    block_size: int
    head_size: int
    inner_layout: str


_TORCH_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.float32": "float32", "torch.uint8": "uint8",
                 "torch.float8_e4m3fn": "float8_e4m3fn"}


class WorkerSide:
    """One worker's attached KV cache and the transfers it waits on."""

    def __init__(self, settings: Settings, block_size: int, num_kv_heads: int,
                 head_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        """``num_kv_heads``: this rank's own heads; ``tp_rank`` of ``tp_size``: its place.

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
        self.attach_socket = settings.attach_sockets[tp_rank]
        self.attachment: Attachment | None = None
        self._shared = SharedMemory()
        self._views: list[torch.Tensor] = []
        self._loads: dict[str, tuple[Load, Receiver | None]] = {}
        #: Each sending request's transfers (one per decode rank this rank covers; None:
        #: never sent).
        self._sends: dict[str, list[Sender | None]] = {}
        self._load_errors: set[int] = set()
        self.moved_bytes = 0
        #: Failed sends and loads since :meth:`take_counts` (vLLM's connector stats).
        self.counts: Counter[str] = Counter()
        #: Decode daemons a send to which could not happen since the last report.
        self._refused: dict[str, str] = {}
        self._reported_detached = ""

    # ---- memory ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Share vLLM's KV allocation, check it is whole blocks per layer, attach it."""
        import torch

        views = list(kv_caches.values())
        storage = views[0].untyped_storage()
        if any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
            raise KvbeamError("vLLM's KV views do not share one allocation")
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        shared = self._shared.share(whole, "vllm-kv")
        for v in views:  # re-point in place: vLLM's layers hold these tensor objects
            v.set_(shared.untyped_storage(), v.storage_offset(), v.size(), v.stride())
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
        refs = []
        for name, v in kv_caches.items():
            per_block = v.stride(0) * v.element_size()
            if int(v.shape[0]) != num_blocks or per_block != item or not _blocks_dense(v):
                raise KvbeamError(f"layer {name}: view {tuple(v.shape)} strides {v.stride()} "
                                  f"is not {num_blocks} contiguous blocks of {item} bytes")
            refs.append(BufferRef(0, int(v.storage_offset()) * v.element_size(), num_blocks * item,
                                  item))
        self._views = views
        config = paged_side_config(self.settings.model, spec)
        # Only a request's end is pushed: get_finished acts on nothing else, and each
        # push would wake the channel's reader thread inside vLLM's worker. A restarted
        # daemon gets the same memory again (reattach); meanwhile new loads and sends
        # fail at once (their channel reads closed), so vLLM recomputes or errors as its
        # kv_load_failure_policy says, and absorb() reads the new channel once back.
        self.attachment = attach(self.attach_socket,
                                 EngineBuffers(list(self._shared.fds), [refs]), config,
                                 pushes="final", reattach=True)
        log.info("attached vLLM's KV cache (TP rank %d of %d): %d layers x %d blocks of %d "
                 "bytes (%s, %d KV heads x %d tokens x head size %d, layout %s) to %s",
                 self.tp_rank, self.tp_size, len(views), num_blocks, item, dtype,
                 live.num_kv_heads, live.block_size, live.head_size, live.inner_layout,
                 self.attach_socket)

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
        """Reserve this step's loads and send its sends, in one write to the daemon."""
        att = self.attachment
        channel = att.channel if att is not None else None
        if att is None or channel is None:
            for load in plan.loads:
                self._loads[load.req_id] = (load, None)
            for push in plan.sends:
                self._sends[push.req_id] = [None]
            if plan.loads or plan.sends:
                log.warning("no engine channel to the daemon: %d load(s) and %d send(s) fail",
                            len(plan.loads), len(plan.sends))
            return
        with channel.batch():
            for load in plan.loads:
                receiver = None
                if not load.failed:
                    receiver = self._receiver(att, load.kvbeam_id, load.prefill_daemons)
                    receiver.reserve(list(load.block_ids), seq_len=load.seq_len,
                                     kv_skip=load.kv_skip)
                self._loads[load.req_id] = (load, receiver)
            for declined in plan.declines:
                self._receiver(att, declined.kvbeam_id, declined.prefill_daemons).decline(
                    declined.why)
            for push in plan.sends:
                senders: list[Sender | None] = []
                if not push.decode_daemons:
                    # No decode named: this rank's share goes to whichever decode daemon
                    # reserves its transfer id (a decode of this TP size: rank to rank).
                    targets = [(rank_transfer_id(push.kvbeam_id, self.tp_rank,
                                                 self.tp_size), "")]
                else:
                    decode_tp = len(push.decode_daemons)
                    targets = [(rank_transfer_id(push.kvbeam_id, d, decode_tp),
                                push.decode_daemons[d])
                               for d in decode_ranks_of(self.tp_rank, self.tp_size, decode_tp)]
                for transfer_id, decode in targets:
                    sender = Sender(att, transfer_id, decode)
                    sender.send(list(push.block_ids), seq_len=push.seq_len)
                    senders.append(sender)
                self._sends[push.req_id] = senders

    def _receiver(self, att: Attachment, kvbeam_id: str, prefill_daemons: tuple[str, ...]
                  ) -> Receiver:
        """This rank's share of a load: its own transfer id, at the prefill rank holding
        its heads."""
        prefill = prefill_daemons[prefill_rank_of(self.tp_rank, self.tp_size,
                                                  len(prefill_daemons))]
        return Receiver(att, rank_transfer_id(kvbeam_id, self.tp_rank, self.tp_size), prefill)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(sends ended, loads ended), from the states the daemon pushed; a failed load's
        blocks go to the load errors."""
        sent = {r for r, senders in self._sends.items()
                if all(s is None or s.poll() in (KVPoll.Success, KVPoll.Failed)
                       for s in senders)}
        for r in sent:
            for sender in self._sends.pop(r):
                failed = sender.failure() if sender is not None else None
                if failed is None:
                    continue
                reason, why = failed
                self.counts[f"send_failed_{reason.value if reason else 'unknown'}"] += 1
                log.warning("request %s: send of transfer %s failed (%s): %s; decode computes "
                            "the prompt", r, sender.request_id if sender else "?",
                            reason.value if reason else "?", why)
                if sender is not None and sender.decode_address and reason in _PAIR_FAILED:
                    self._refused[sender.decode_address] = f"{reason.value}: {why}"
        received: set[str] = set()
        with self._batch():
            for r, (load, receiver) in list(self._loads.items()):
                state = KVPoll.Failed if receiver is None else receiver.poll()
                if state is KVPoll.Success:
                    assert receiver is not None
                    self._landed(load, receiver)
                elif state is KVPoll.Failed:
                    failure = receiver.failure() if receiver is not None else None
                    label = (failure[0].value if failure and failure[0]
                             else "not_reserved")
                    self.counts[f"load_failed_{label}"] += 1
                    log.warning("request %s: transfer %s failed (%s: %s); vLLM gets its blocks "
                                "as load errors (kv_load_failure_policy)", r, load.kvbeam_id,
                                label, failure[1] if failure else "not reserved")
                    self._load_errors.update(load.block_ids)
                else:
                    continue
                received.add(r)
                del self._loads[r]
        return sent, received

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

    def take_counts(self) -> dict[str, int]:
        """Failed sends and loads since the last call, by reason; then zero."""
        out, self.counts = dict(self.counts), Counter()
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
        """Detach (the daemon fails what is still moving) and close the memfds."""
        if self.attachment is not None:
            self.attachment.close()
        self._shared.close()


def _blocks_dense(v: torch.Tensor) -> bool:
    """A block's bytes are one contiguous run: the view is contiguous after dim 0."""
    return bool(v[0].is_contiguous())
