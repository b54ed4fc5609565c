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

The same hooks remember each pool object (weakly, :func:`remember`): the manager reads
the pools' description from the ones its ``KVArgs`` points at
(:mod:`kvbeam.integrations.sglang.describe`), never from a file. DeepSeek-V4 pools are
remembered too (their memory is not moved: not supported yet), and the metadata
buffers (:func:`metadata_for`).

Staged (:mod:`kvbeam.integrations.sglang.staged`: ``KVBEAM_STAGING=1``, or a pool on a
GPU, which no daemon can map) nothing is moved: the tensors stay where sglang put them
and the manager copies through a staging buffer instead.
"""

from __future__ import annotations

import functools
import logging
import weakref
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


#: The pool kinds :func:`remember` takes: sglang's MHA pool, DeepSeek-V4's pool.
MHA, DSV4 = "sglang_mha", "dsv4"
#: sglang's pool objects of this process (weakly held), with their kind.
_POOLS: list[tuple[weakref.ref[Any], str]] = []
#: sglang's metadata buffers of this process (weakly held).
_METADATA: list[weakref.ref[Any]] = []


def remember(pool: Any, kind: str) -> None:
    """Record a pool object sglang built (``kind``: :data:`MHA` or :data:`DSV4`)."""
    if kind not in (MHA, DSV4):
        raise ValueError(f"unknown sglang pool kind {kind!r}")
    _POOLS[:] = [(ref, k) for ref, k in _POOLS if ref() is not None]
    _POOLS.append((weakref.ref(pool), kind))


def _first_pointer(pool: Any) -> int | None:
    try:
        ptrs = pool.get_contiguous_buf_infos()[0]
    except Exception:  # a pool sglang cannot describe for transfer: not ours to match
        return None
    return int(ptrs[0]) if ptrs else None


def pools_for(kv_args: Any) -> tuple[tuple[Any, str] | None, tuple[Any, str] | None]:
    """The remembered pools ``kv_args`` points at: (target, draft), each (pool, kind) or
    None. The target's first transfer buffer is ``kv_data_ptrs[0]``; a draft is another
    remembered pool whose first buffer is among the KV or state pointers (sglang appends
    the draft's after the target's)."""
    kv = [int(p) for p in getattr(kv_args, "kv_data_ptrs", ())]
    pointers = set(kv)
    for ptrs in getattr(kv_args, "state_data_ptrs", ()) or ():
        pointers.update(int(p) for p in ptrs)
    target = draft = None
    for ref, kind in _POOLS:
        pool = ref()
        first = None if pool is None else _first_pointer(pool)
        if first is None:
            continue
        if kv and first == kv[0]:
            target = (pool, kind)
        elif first in pointers:
            draft = (pool, kind)
    return target, draft


def metadata_for(kv_args: Any) -> Any:
    """The remembered metadata buffers whose rows ``KVArgs`` points at (None: none)."""
    aux = [int(p) for p in getattr(kv_args, "aux_data_ptrs", ()) or ()]
    for ref in _METADATA:
        buffers = ref()
        if buffers is None:
            continue
        ptrs = {int(t.data_ptr()) for t in (getattr(buffers, f, None) for f in METADATA_FIELDS)
                if t is not None}
        if aux and aux[0] in ptrs:
            return buffers
    return None


def _stays(tensors: Sequence[Any]) -> bool:
    """True when these tensors stay where sglang put them (staged): asked for, or not in
    host memory (a GPU's, which no daemon maps)."""
    from kvbeam.integrations.sglang.staged import staging_requested

    return staging_requested() is True or any(
        t is not None and t.device.type != "cpu" for t in tensors)


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
    n = len(pool.k_buffer)
    remember(pool, MHA)
    if _stays([*pool.k_buffer, *pool.v_buffer]):
        log.info("kvbeam: sglang KV pool (%d K and %d V buffers) stays on %s (staged)", n, n,
                 pool.k_buffer[0].device if n else "?")
        return
    k = share_tensors([*pool.k_buffer, *pool.v_buffer], "sglang.kv")
    pool.k_buffer, pool.v_buffer = k[:n], k[n:]
    log.info("kvbeam: sglang KV pool (%d K and %d V buffers) in sealed memfds", n, n)


def _move_metadata(buffers: Any) -> None:
    names = [f for f in METADATA_FIELDS if getattr(buffers, f, None) is not None]
    _METADATA[:] = [ref for ref in _METADATA if ref() is not None]
    _METADATA.append(weakref.ref(buffers))
    if _stays([getattr(buffers, f) for f in names]):
        log.info("kvbeam: sglang metadata rows (%d buffers) stay where they are (staged)",
                 len(names))
        return
    for name, moved in zip(names, share_tensors([getattr(buffers, f) for f in names],
                                                "sglang.aux"), strict=True):
        setattr(buffers, name, moved)
    log.info("kvbeam: sglang metadata rows (%d buffers) in sealed memfds", len(names))


def install() -> None:
    """Wrap sglang's MHA pool and metadata-buffer allocation, and remember DeepSeek-V4
    pools (idempotent)."""
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if not getattr(MHATokenToKVPool._create_buffers_normal, "_kvbeam", False):
        MHATokenToKVPool._create_buffers_normal = _after(
            MHATokenToKVPool._create_buffers_normal, _move_pool)
    if not getattr(MetadataBuffers.__init__, "_kvbeam", False):
        MetadataBuffers.__init__ = _after(MetadataBuffers.__init__, _move_metadata)
    try:
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    except ImportError as exc:  # its kernels' imports fail on some platforms
        log.debug("kvbeam: DeepSeek-V4 pools not hooked: %s", exc)
        return
    if not getattr(DeepSeekV4TokenToKVPool.__init__, "_kvbeam", False):
        DeepSeekV4TokenToKVPool.__init__ = _after(DeepSeekV4TokenToKVPool.__init__,
                                                  lambda pool: remember(pool, DSV4))
