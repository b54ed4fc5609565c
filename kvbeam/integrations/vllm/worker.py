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
from typing import TYPE_CHECKING

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
from kvbeam.integrations.vllm.scheduler import Load, StepPlan
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
from kvbeam.proto.attach_codec import BufferRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

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
        dtype = _TORCH_DTYPES.get(str(views[0].dtype))
        if dtype is None:
            raise KvbeamError(f"KV dtype {views[0].dtype} has no kvbeam name")
        num_blocks = int(views[0].shape[0])
        spec = paged_spec(num_layers=len(views), block_size=self.block_size,
                          num_kv_heads=self.num_kv_heads, head_size=self.head_size, dtype=dtype,
                          inner_layout=self.settings.inner_layout, num_blocks=num_blocks,
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
        log.info("attached vLLM's KV cache (TP rank %d of %d, %d KV heads): %d layers x %d "
                 "blocks of %d bytes to %s", self.tp_rank, self.tp_size, self.num_kv_heads,
                 len(views), num_blocks, item, self.attach_socket)

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
                decode_tp = len(push.decode_daemons)
                for d in decode_ranks_of(self.tp_rank, self.tp_size, decode_tp):
                    sender = Sender(att, rank_transfer_id(push.kvbeam_id, d, decode_tp),
                                    push.decode_daemons[d])
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
                if failed is not None:
                    log.warning("request %s: send of transfer %s failed: %s", r,
                                sender.request_id if sender else "?", failed[1])
        received: set[str] = set()
        with self._batch():
            for r, (load, receiver) in list(self._loads.items()):
                state = KVPoll.Failed if receiver is None else receiver.poll()
                if state is KVPoll.Success:
                    assert receiver is not None
                    self._landed(load, receiver)
                elif state is KVPoll.Failed:
                    why = receiver.failure() if receiver is not None else None
                    log.warning("request %s: transfer %s failed (%s); vLLM gets its blocks as "
                                "load errors", r, load.kvbeam_id, why[1] if why else "not "
                                "reserved")
                    self._load_errors.update(load.block_ids)
                else:
                    continue
                received.add(r)
                del self._loads[r]
        return sent, received

    def _batch(self) -> contextlib.AbstractContextManager[None]:
        channel = self.attachment.channel if self.attachment is not None else None
        return channel.batch() if channel is not None else contextlib.nullcontext()

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
