"""sglang's KV pool and metadata rows in shareable, sealed memory (memfds).

sglang allocates its ``MHATokenToKVPool`` buffers and its disaggregation
``MetadataBuffers`` with ``torch.zeros``: anonymous memory, which a kvbeam daemon
cannot map (attach refuses it). :func:`install` wraps the two allocations so that, in a
server whose ``--disaggregation-transfer-backend`` is ``kvbeam``, each storage they
allocated is replaced, right after, by a memfd-backed one of the same size
(:class:`kvbeam.engine.SharedMemory`: size-sealed memfds whose fds the process keeps),
every tensor keeping its shape, strides and offset. The replacement runs inside
sglang's own allocation functions, before anything reads the pointers (sglang builds
its pointer tables and ``KVArgs`` afterwards), and the buffers are still zero. Other
backends and other pool classes are left alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvbeam.engine import SharedMemory

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: The memfds of this process's pools; kept for the process's life (the manager finds
#: each KVArgs pointer's fd among the open ones).
_SHARED = SharedMemory()
#: The metadata fields sglang 0.5.23's ``MetadataBuffers.get_buf_infos`` hands over.
METADATA_FIELDS = ("output_ids", "cached_tokens", "output_token_logprobs_val",
                   "output_token_logprobs_idx", "output_top_logprobs_val",
                   "output_top_logprobs_idx", "output_token_sampling_mask_len",
                   "output_token_sampling_mask_idx", "output_token_sampling_logprobs",
                   "output_topk_p", "output_topk_index", "output_hidden_states",
                   "output_dsa_topk_indices", "bootstrap_room", "kv_checksum")


def kvbeam_selected() -> bool:
    """True in a server process whose transfer backend is kvbeam."""
    try:
        from sglang.srt.runtime_context import get_disagg

        return bool(get_disagg().disaggregation_transfer_backend == "kvbeam")
    except Exception:  # no server context (a tool, a test): not a kvbeam server
        return False


def share_tensors(tensors: Sequence[torch.Tensor | None], name: str,
                  shared: SharedMemory | None = None) -> list[torch.Tensor | None]:
    """The same tensors over memfd-backed copies of their storages (one memfd each).

    Tensors that share a storage (sglang's fused K/V halves) share the new one, at the
    same offsets; ``None`` entries stay None.
    """
    import torch

    shared = shared if shared is not None else _SHARED
    moved: dict[int, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        if t.device.type != "cpu":
            raise ValueError(f"{name}: kvbeam shares CPU memory only (got {t.device}); GPU "
                             "pools need dma-buf (docs/engine.md#gpu-memory-the-plan)")
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in moved:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            moved[key] = shared.share(whole, name)
        base = moved[key].untyped_storage()
        out.append(torch.empty(0, dtype=t.dtype).set_(base, t.storage_offset(), t.size(),
                                                      t.stride()))
    return out


def _after(method: Callable[..., Any], move: Callable[[Any], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if kvbeam_selected():
            move(self)
        return result

    wrapper._kvbeam = True  # type: ignore[attr-defined]
    return wrapper


def _move_pool(pool: Any) -> None:
    k = share_tensors([*pool.k_buffer, *pool.v_buffer], "sglang.kv")
    n = len(pool.k_buffer)
    pool.k_buffer, pool.v_buffer = k[:n], k[n:]
    log.info("kvbeam: sglang KV pool (%d K and %d V buffers) in sealed memfds", n, n)


def _move_metadata(buffers: Any) -> None:
    names = [f for f in METADATA_FIELDS if getattr(buffers, f, None) is not None]
    for name, moved in zip(names, share_tensors([getattr(buffers, f) for f in names],
                                                "sglang.aux"), strict=True):
        setattr(buffers, name, moved)
    log.info("kvbeam: sglang metadata rows (%d buffers) in sealed memfds", len(names))


def install() -> None:
    """Wrap sglang's MHA pool and metadata-buffer allocation (idempotent)."""
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if not getattr(MHATokenToKVPool._create_buffers_normal, "_kvbeam", False):
        MHATokenToKVPool._create_buffers_normal = _after(
            MHATokenToKVPool._create_buffers_normal, _move_pool)
    if not getattr(MetadataBuffers.__init__, "_kvbeam", False):
        MetadataBuffers.__init__ = _after(MetadataBuffers.__init__, _move_metadata)
