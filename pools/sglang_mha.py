"""The sglang_mha pool kind: sglang's ``MHATokenToKVPool`` and its metadata rows.

sglang's MHA pool (``sglang.srt.mem_cache.memory_pool.MHATokenToKVPool``, NHD layout)
hands a transfer backend ``2L`` buffers in ``KVArgs.kv_data_*``: K of layers ``0..L-1``,
then V of layers ``0..L-1``, each ``size + page_size`` token rows of ``num_kv_heads x
head_dim`` elements; one item (one ``KV_PAGES`` index) is a page: ``page_size x
num_kv_heads x head_dim x dtype`` bytes. Beside them, ``KVArgs.aux_*`` are sglang's
metadata buffers (``MetadataBuffers``: first output token, cached tokens, logprobs,
..., bootstrap room), one row per request; decode commits a request only once its row
has landed, so the row moves with the KV as the ``AUX`` component (``REQ_SLOT``: the
request's ``metadata_buffer_index``).

The pool is a :class:`~kvbeam.pools.spec.PoolSpec` of kind ``sglang_mha``: like the
paged kind, ``compression_ratios`` has one 0 per layer, ``page_size`` and ``head_dim``
are sglang's, ``max_context_len`` is the token rows of each K or V buffer (``size +
page_size``), ``inner_layout`` sglang's ``kv_cache_layout`` (``nhd``); ``aux_item_lens``
and ``aux_rows`` describe the metadata buffers. The handshake compares the paged
fields and every buffer's item length (so the two sides' metadata rows must agree);
capacities (token rows, metadata rows) may differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbeam.pools.spec import PoolSpec

#: sglang's NHD layout name (``MHATokenToKVPool.kv_cache_layout``), the only one moved.
NHD = "nhd"


def sglang_mha_spec(*, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                    dtype: str, token_rows: int, aux_item_lens: Sequence[int],
                    aux_rows: int, max_inflight: int = 64) -> PoolSpec:
    """A validated sglang_mha spec: K/V buffers of ``token_rows`` rows (sglang's ``size +
    page_size``), metadata buffers of ``aux_rows`` rows, ``max_inflight`` moving at once."""
    spec = PoolSpec(compression_ratios=(0,) * num_layers, page_size=page_size,
                    head_dim=head_dim, num_kv_heads=num_kv_heads, dtype=dtype,
                    kind="sglang_mha", inner_layout=NHD, num_req_slots=max_inflight,
                    max_context_len=token_rows, aux_item_lens=tuple(aux_item_lens),
                    aux_rows=aux_rows)
    spec.validate("sglang_mha pool")
    return spec


def page_bytes(spec: PoolSpec) -> int:
    """Bytes of one page of one layer's K (or V): ``page_size x heads x head_dim x dtype``."""
    return spec.page_size * spec.num_kv_heads * spec.head_dim * spec.element_size
