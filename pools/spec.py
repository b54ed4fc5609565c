"""Pool specs: the validated, typed description of a DeepSeek-V4 pool, loadable from YAML.

A side config (one YAML file per daemon) names the model and holds the target
pool spec and, when speculative decoding (NextN) is on, the draft pool spec::

    model: dsv4-tiny
    target:
      compression_ratios: [0, 4, 128, 4, 128, 0]
      unified_kv: true
      ...
    draft:
      compression_ratios: [0]
      ...

Every derived geometry (ring sizes, page counts) is a property here, so there is
one place that says how a spec becomes a layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from kvbeam.errors import ConfigError

#: dtype name -> bytes per element. The names are torch's.
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "uint8": 1,
}
VALID_RATIOS = (0, 4, 128)
#: The longest sliding window a spec may ask for, in tokens. DSV4's is 128; the bound keeps
#: every per-window table (the SWA mapping's fingerprint evaluates two ring periods) small.
MAX_SLIDING_WINDOW = 1 << 20
#: The most speculative draft tokens per verify step (sglang runs 1-8).
MAX_DRAFT_TOKENS = 1024
#: Compression-state rows are float32 (value and score halves).
STATE_ELEMENT_SIZE = 4
#: Pool kinds: DeepSeek-V4's SWA/C4/C128 pools, generic per-layer paged K/V blocks
#: (vLLM-style full attention; :mod:`kvbeam.pools.paged`), or sglang's MHA pool (K and V
#: buffers apart, plus sglang's per-request metadata rows; :mod:`kvbeam.pools.sglang_mha`).
POOL_KINDS = ("dsv4", "paged", "sglang_mha")
#: The kinds of full-attention pages (no DSV4 modes, no draft pool).
PAGED_KINDS = ("paged", "sglang_mha")


@dataclass(frozen=True)
class PoolSpec:
    """One DSV4 token-to-KV pool (the target model's, or the NextN draft's).

    Attributes:
        compression_ratios: per layer: 0 = SWA-only, 4 = C4, 128 = C128.
        unified_kv: one buffer per layer holding the SWA ring rows, then the
            compressed rows (sglang's unified-KV mode); otherwise a paged SWA pool
            and separate compressed buffers.
        sliding_window: SWA window in tokens.
        num_draft_tokens: speculative draft tokens per verify step; 0 = no speculation.
        page_size: tokens per KV page.
        num_req_slots: request slots (``req_pool_idx`` range).
        max_context_len: tokens one request slot can hold.
        head_dim: elements per KV row.
        indexer_head_dim: elements per C4 indexer row.
        dtype: KV element type (torch name).
        online_c128: online C128 compression (one state row per request).
        swa_ring_size: unified SWA ring rows per request; default
            ``sliding_window + num_draft_tokens - 1`` when speculative, else the window.
        swa_pages_per_req: paged SWA pool pages per request slot; default
            ``ceil(sliding_window / page_size) + 1`` (a window not aligned to pages
            spans one extra page).
        kind: ``dsv4`` (the fields above) or ``paged``: per-layer K and V blocks of
            ``page_size`` tokens x ``num_kv_heads`` x ``head_dim`` (one layer per
            ``compression_ratios`` entry, all 0), ``max_context_len / page_size``
            blocks per layer (:func:`kvbeam.pools.paged.paged_spec`).
        num_kv_heads: KV heads per block (paged kind; 1 for DSV4).
        inner_layout: the engine's name for the order of a block's bytes (paged kind,
            e.g. vLLM CPU's ``LBHNC``; sglang_mha: sglang's ``kv_cache_layout``, ``nhd``):
            both sides must use the same one.
        aux_item_lens: sglang_mha: bytes of one request's row in each of sglang's
            metadata buffers (``KVArgs.aux_item_lens``), in sglang's order.
        aux_rows: sglang_mha: rows of each metadata buffer (requests it can hold; each
            side has its own count).
        tp_rank: paged: this pool's tensor-parallel rank in its instance (0-based).
        tp_size: paged: the instance's tensor-parallel size. The pool holds KV heads
            ``[tp_rank * num_kv_heads, (tp_rank + 1) * num_kv_heads)`` of
            ``num_kv_heads * tp_size``; the handshake pairs a prefill rank with a
            decode rank whose heads it contains (docs/pools.md, "Tensor parallelism").
    """

    compression_ratios: tuple[int, ...]
    unified_kv: bool = False
    sliding_window: int = 128
    num_draft_tokens: int = 0
    page_size: int = 256
    num_req_slots: int = 8
    max_context_len: int = 8192
    head_dim: int = 128
    indexer_head_dim: int = 64
    dtype: str = "bfloat16"
    online_c128: bool = False
    swa_ring_size: int | None = None
    swa_pages_per_req: int | None = None
    kind: str = "dsv4"
    num_kv_heads: int = 1
    inner_layout: str = ""
    aux_item_lens: tuple[int, ...] = ()
    aux_rows: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    # ---- derived geometry -------------------------------------------------
    @property
    def speculative(self) -> bool:
        """True when speculative decoding (NextN) is on."""
        return self.num_draft_tokens > 0

    @property
    def ring_size(self) -> int:
        """SWA ring rows per request (unified mode)."""
        if self.swa_ring_size is not None:
            return self.swa_ring_size
        extra = self.num_draft_tokens - 1 if self.speculative else 0
        return self.sliding_window + extra

    @property
    def swa_pages(self) -> int:
        """SWA ring rows in each unified buffer: ``num_req_slots * ring_size``."""
        return self.num_req_slots * self.ring_size

    @property
    def swa_pages_per_request(self) -> int:
        """Paged SWA pool pages reserved per request slot."""
        if self.swa_pages_per_req is not None:
            return self.swa_pages_per_req
        return self.min_swa_pages_per_req

    @property
    def min_swa_pages_per_req(self) -> int:
        """Fewest SWA pages that hold a window starting anywhere inside a page."""
        return math.ceil(self.sliding_window / self.page_size) + 1

    @property
    def c4_ring_size(self) -> int:
        """C4 compression-state ring rows per request: 8, or 16 with speculation."""
        return 16 if self.speculative else 8

    @property
    def c128_ring_size(self) -> int:
        """C128 compression-state rows per request: 128, 256 with speculation, 1 online."""
        if self.online_c128:
            return 1
        return 256 if self.speculative else 128

    @property
    def element_size(self) -> int:
        """Bytes per KV element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_row_bytes(self) -> int:
        """Bytes per KV row (one token of one layer)."""
        return self.head_dim * self.element_size

    @property
    def indexer_row_bytes(self) -> int:
        """Bytes per C4 indexer row."""
        return self.indexer_head_dim * self.element_size

    @property
    def total_kv_heads(self) -> int:
        """KV heads of the whole model layer: this pool's times the tensor-parallel size."""
        return self.num_kv_heads * self.tp_size

    @property
    def max_pages_per_req(self) -> int:
        """Full-KV pages one request slot owns."""
        return math.ceil(self.max_context_len / self.page_size)

    @property
    def full_pages(self) -> int:
        """Full-KV pages in the pool (every slot's pages)."""
        return self.num_req_slots * self.max_pages_per_req

    # ---- construction -----------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> PoolSpec:
        """Build and validate a spec from a mapping; ``where`` prefixes every error."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping of pool fields, got {_show(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown field(s) {', '.join(map(str, unknown))}; "
                f"known fields: {', '.join(sorted(known))}"
            )
        if "compression_ratios" not in data:
            raise ConfigError(f"{where}.compression_ratios: required field is missing")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            values[f.name] = _coerce(f.name, data[f.name], f"{where}.{f.name}")
        spec = cls(**values)
        spec.validate(where)
        return spec

    def validate(self, where: str) -> None:
        """Refuse a spec that cannot be built, naming the field and the value."""

        def bad(name: str, problem: str) -> ConfigError:
            return ConfigError(f"{where}.{name}: {problem} (got {getattr(self, name)!r})")

        for r in self.compression_ratios:
            if r not in VALID_RATIOS:
                raise bad("compression_ratios", f"each ratio must be 0, 4 or 128, not {r}")
        for name in ("sliding_window", "page_size", "num_req_slots", "max_context_len",
                     "head_dim", "indexer_head_dim"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be a positive integer")
        if self.sliding_window > MAX_SLIDING_WINDOW:
            raise bad("sliding_window", f"must be at most {MAX_SLIDING_WINDOW} tokens")
        if self.num_draft_tokens < 0:
            raise bad("num_draft_tokens", "must be >= 0 (0 turns speculation off)")
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            raise bad("num_draft_tokens", f"must be at most {MAX_DRAFT_TOKENS}")
        for name in ("swa_ring_size", "swa_pages_per_req"):
            value = getattr(self, name)
            if value is not None and value > 2 * MAX_SLIDING_WINDOW:
                raise bad(name, f"must be at most {2 * MAX_SLIDING_WINDOW}")
        if self.dtype not in DTYPE_SIZES:
            raise bad("dtype", f"unknown dtype; use one of {', '.join(DTYPE_SIZES)}")
        if self.swa_ring_size is not None and self.swa_ring_size < self.sliding_window:
            raise bad("swa_ring_size", f"ring must hold the window ({self.sliding_window} rows)")
        for r in sorted(set(self.compression_ratios) - {0}):
            if self.page_size % r:
                raise bad("page_size", f"must be a multiple of every compression ratio ({r})")
        if self.kind not in POOL_KINDS:
            raise bad("kind", f"unknown pool kind; use one of {', '.join(POOL_KINDS)}")
        if self.num_kv_heads <= 0:
            raise bad("num_kv_heads", "must be a positive integer")
        if self.tp_size <= 0:
            raise bad("tp_size", "must be a positive integer (1: no tensor parallelism)")
        if not 0 <= self.tp_rank < self.tp_size:
            raise bad("tp_rank", f"must be in 0..tp_size-1 = 0..{self.tp_size - 1}")
        if self.tp_size != 1 and self.kind != "paged":
            raise bad("tp_size", "tensor-parallel ranks belong to the paged kind")
        if self.kind in PAGED_KINDS:
            self._validate_paged(bad)
        elif self.num_kv_heads != 1 or self.inner_layout:
            raise bad("kind", "num_kv_heads and inner_layout belong to the paged kinds")
        if self.kind == "sglang_mha":
            if not self.aux_item_lens or any(n <= 0 for n in self.aux_item_lens):
                raise bad("aux_item_lens", "sglang_mha needs the byte length of each of "
                          "sglang's metadata buffers' rows (KVArgs.aux_item_lens), all > 0")
            if self.aux_rows <= 0:
                raise bad("aux_rows", "sglang_mha needs its metadata buffers' row count > 0")
        elif self.aux_item_lens or self.aux_rows:
            raise bad("kind", "aux_item_lens and aux_rows belong to the sglang_mha kind")
        if (self.swa_pages_per_req is not None
                and self.swa_pages_per_req < self.min_swa_pages_per_req):
            raise bad(
                "swa_pages_per_req",
                f"must be >= ceil(sliding_window / page_size) + 1 = {self.min_swa_pages_per_req}",
            )


    def _validate_paged(self, bad: Callable[[str, str], ConfigError]) -> None:
        """A paged pool: full-attention layers only, no DSV4 modes."""
        if any(r != 0 for r in self.compression_ratios):
            raise bad("compression_ratios", "a paged pool has one 0 per layer")
        if self.unified_kv or self.online_c128 or self.num_draft_tokens:
            raise bad("kind", "unified_kv, online_c128 and num_draft_tokens are DSV4 modes")
        if not self.inner_layout:
            raise bad("inner_layout", "a paged pool names its blocks' inner layout")
        if self.max_context_len % self.page_size:
            raise bad("max_context_len", "must be whole blocks (a multiple of page_size)")


@dataclass(frozen=True)
class SideConfig:
    """A daemon's pools: the model identity, the target pool and the optional draft pool."""

    model: str
    target: PoolSpec
    draft: PoolSpec | None = None
    source: str = "<config>"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<config>") -> SideConfig:
        """Build and validate a side config from a parsed YAML mapping."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a mapping at the top level, got {_show(data)}")
        unknown = sorted(set(data) - {"model", "target", "draft"})
        if unknown:
            raise ConfigError(
                f"{source}: unknown top-level field(s) {', '.join(map(str, unknown))}; "
                "known: model, target, draft"
            )
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{source}: model: must be a non-empty string (got {model!r})")
        if "target" not in data:
            raise ConfigError(f"{source}: target: required field is missing")
        target = PoolSpec.from_mapping(data["target"], f"{source}: target")
        if not target.compression_ratios:
            raise ConfigError(f"{source}: target.compression_ratios: must list at least one layer")
        draft = None
        if data.get("draft") is not None:
            draft = PoolSpec.from_mapping(data["draft"], f"{source}: draft")
            if target.kind in PAGED_KINDS:
                raise ConfigError(f"{source}: draft: a {target.kind} pool has no draft pool")
        return cls(model=model, target=target, draft=draft, source=source)


def load_side_config(path: str | Path) -> SideConfig:
    """Read and validate a side config YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    return SideConfig.from_mapping(data, source=str(p))


def _show(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def _coerce(name: str, value: Any, where: str) -> Any:
    """Check one field's type strictly: YAML ``yes`` is not a ratio, ``1.5`` is not a size."""
    if name == "compression_ratios":
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: must be a list of 0/4/128 (got {_show(value)})")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise ConfigError(f"{where}: every ratio must be an integer (got {_show(item)})")
        return tuple(value)
    if name == "aux_item_lens":
        if not isinstance(value, list | tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) for i in value):
            raise ConfigError(f"{where}: must be a list of byte lengths (got {_show(value)})")
        return tuple(value)
    if name in ("unified_kv", "online_c128"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false (got {_show(value)})")
        return value
    if name in ("dtype", "kind", "inner_layout"):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string (got {_show(value)})")
        return value
    if name in ("swa_ring_size", "swa_pages_per_req") and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: must be an integer (got {_show(value)})")
    return value
