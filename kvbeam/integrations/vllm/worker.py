"""The connector's worker side: vLLM's KV cache in shared memory, attached; transfer polling.

Runs in vLLM's worker process. :meth:`WorkerSide.register_kv_caches` moves the one
allocation vLLM's per-layer views share into a memfd (every view is re-pointed in
place, so vLLM's attention layers keep using the same tensor objects) and attaches it
to the local ``--pools engine`` daemon as a paged pool: one buffer per layer, one
item per block. The daemons move the bytes; this side only asks the local daemon how
each transfer it was told about ended (:meth:`WorkerSide.get_finished`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvbeam.engine import Attachment, EngineBuffers, KVPoll, SharedMemory, attach
from kvbeam.engine.requests import client_for, poll_of
from kvbeam.errors import KvbeamError
from kvbeam.integrations.vllm.params import Settings
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
                 head_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.attachment: Attachment | None = None
        self._shared = SharedMemory()
        self._views: list[torch.Tensor] = []
        self._loads: dict[str, Load] = {}
        self._sends: dict[str, str] = {}
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
                          inner_layout=self.settings.inner_layout, num_blocks=num_blocks)
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
        self.attachment = attach(self.settings.attach_socket,
                                 EngineBuffers(list(self._shared.fds), [refs]), config)
        log.info("attached vLLM's KV cache: %d layers x %d blocks of %d bytes to %s",
                 len(views), num_blocks, item, self.settings.attach_socket)

    # ---- transfers ---------------------------------------------------------------
    def absorb(self, plan: StepPlan) -> None:
        """Take the scheduler's new loads and sends of this step."""
        for load in plan.loads:
            self._loads[load.req_id] = load
        for req_id, kvbeam_id in plan.sends:
            self._sends[req_id] = kvbeam_id

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(sends ended, loads ended); a failed load's blocks go to the load errors."""
        sent = {r for r, k in self._sends.items() if self._ended_send(k)}
        for r in sent:
            del self._sends[r]
        received: set[str] = set()
        for r, load in list(self._loads.items()):
            state = KVPoll.Failed if load.failed else self._poll_load(load)
            if state is KVPoll.Success:
                self._landed(load)
            elif state is KVPoll.Failed:
                log.warning("request %s: transfer %s failed; vLLM gets its blocks as load "
                            "errors", r, load.kvbeam_id)
                self._load_errors.update(load.block_ids)
            else:
                continue
            received.add(r)
            del self._loads[r]
        return sent, received

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def _poll(self, kvbeam_id: str) -> KVPoll | None:
        """The transfer's state on the local daemon; None when the daemon does not know it."""
        try:
            return poll_of(client_for(self.settings.daemon).status(kvbeam_id).state)
        except KvbeamError:
            return None

    def _ended_send(self, kvbeam_id: str) -> bool:
        # Unknown to the daemon: nothing of it is in flight any more either.
        return self._poll(kvbeam_id) in (KVPoll.Success, KVPoll.Failed, None)

    def _poll_load(self, load: Load) -> KVPoll:
        return self._poll(load.kvbeam_id) or KVPoll.Failed

    def _landed(self, load: Load) -> None:
        self.moved_bytes += len(load.block_ids) * sum(
            v.stride(0) * v.element_size() for v in self._views)
        try:  # the engine took the KV over: decode's daemon frees the reservation
            client_for(self.settings.daemon).release(load.kvbeam_id)
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
