"""The engine's own description of its pools: kvbeam's side config read from sglang.

What the daemons' handshake compares must be what sglang really allocated, not what a
file says (a ``dtype: float16`` YAML beside a ``--kv-cache-dtype bfloat16`` server moved
bytes that decode read as the wrong type, every transfer "verified"). So the backend
reads it from sglang's live pool objects (recorded as sglang builds them,
:mod:`kvbeam.integrations.sglang.memory`) and from ``KVArgs``, which sglang fills from
the same objects:

- ``sglang_mha`` (``MHATokenToKVPool``): everything. Layers, page size, KV heads, head
  dim, dtype, layout and token rows from the pool; the metadata buffers' item lengths and
  rows from ``KVArgs.aux_*`` (``MetadataBuffers.get_buf_infos()``); transfers in flight:
  one per metadata row; the model: sglang's ``--served-model-name``. A side YAML
  (``KVBEAM_CONFIG``) is optional, and checked: any field that differs is refused.
- ``dsv4`` (``DeepSeekV4TokenToKVPool``): the attributes sglang's own
  ``setup_state_kv_args`` reads for its target/draft checks (compression ratios, the
  unified-KV flag, page size, SWA window, ring size and ring pages, the draft's), checked
  against the side YAML, which stays required for the rest.

:func:`peer_differences` compares the two servers' descriptions with the handshake's own
comparison (:func:`kvbeam.pools.checks.compare_sides`) and names the sglang setting that
decides each field. No sglang or torch import.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvbeam.errors import ConfigError, Difference, KvbeamError
from kvbeam.pools.checks import compare_sides
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.sglang_mha import NHD, sglang_mha_spec
from kvbeam.pools.spec import DTYPE_SIZES, PoolSpec, SideConfig

log = logging.getLogger(__name__)

#: The sglang setting that decides each compared field (by the handshake's field names
#: and :class:`~kvbeam.pools.spec.PoolSpec`'s), for messages.
SGLANG_SETTING: dict[str, str] = {
    "model": "--served-model-name (default: --model-path)",
    "dtype": "--kv-cache-dtype ('auto' follows --dtype)",
    "page_size": "--page-size",
    "block_size": "--page-size",
    "num_layers": "the model (--model-path)",
    "compression_ratios": "the model (--model-path)",
    "num_kv_heads": "the model (--model-path) and --tp-size",
    "head_dim": "the model (--model-path)",
    "head_size": "the model (--model-path)",
    "inner_layout": "the KV cache layout (SGLANG_USE_HND_KVCACHE)",
    "kind": "the model's KV pool class",
    "max_context_len": "--max-total-tokens and --page-size",
    "num_req_slots": "--max-running-requests",
    "aux_item_lens": "the model and --speculative-algorithm (sglang's metadata rows)",
    "aux_rows": "--max-running-requests",
    "components": "the model and --speculative-algorithm (sglang's metadata rows)",
    "unified_kv": "the DeepSeek-V4 unified-KV mode",
    "sliding_window": "the model (--model-path)",
    "swa_ring_size": "the DeepSeek-V4 SWA ring (--speculative-num-draft-tokens)",
    "ring_size": "the DeepSeek-V4 SWA ring (--speculative-num-draft-tokens)",
    "swa_pages": "--max-running-requests (the DeepSeek-V4 SWA ring pages)",
    "draft": "--speculative-algorithm",
}


def setting_for(field: str) -> str:
    """The sglang setting behind a field name (``draft.page_size``, ``components[3]...``)."""
    name = field.removeprefix("draft.")
    name = name.split("[", 1)[0].split(".", 1)[0]
    return SGLANG_SETTING.get(name, "the model and its sglang server flags")


@dataclass(frozen=True)
class EngineDescription:
    """What the backend read of sglang's pools.

    Attributes:
        derived: ``pool.field`` -> value for every field read from sglang (``target.dtype``
            ...); a field is a :class:`PoolSpec` attribute (a property for DSV4's ring).
        config: the whole side config when every field was read (``sglang_mha``); None
            when a side YAML must supply the rest (``dsv4``).
        source: what it was read from, for messages.
    """

    derived: Mapping[str, Any]
    config: SideConfig | None
    source: str


def torch_dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``float16`` (kvbeam's names are torch's); refused when kvbeam
    has no size for it."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError(f"sglang's KV cache dtype {name}: kvbeam moves "
                          f"{', '.join(DTYPE_SIZES)} (--kv-cache-dtype)")
    return name


def metadata_rows(kv_args: Any) -> tuple[tuple[int, ...], int]:
    """sglang's metadata buffers (``KVArgs.aux_*``): each row's bytes and the row count
    (every buffer has the same rows)."""
    items = tuple(int(n) for n in kv_args.aux_item_lens)
    lens = [int(n) for n in kv_args.aux_data_lens]
    if not items or len(lens) != len(items) or any(i <= 0 for i in items):
        raise ConfigError(f"sglang's metadata buffers (KVArgs.aux_*): {len(lens)} buffers, "
                          f"item lengths {list(items)}: kvbeam needs at least one, each > 0")
    rows = {n // i for n, i in zip(lens, items, strict=True)}
    if len(rows) != 1 or any(n % i for n, i in zip(lens, items, strict=True)):
        raise ConfigError(f"sglang's metadata buffers hold different row counts "
                          f"(lengths {lens}, item lengths {list(items)})")
    return items, rows.pop()


def model_name(server_args: Any) -> str | None:
    """The model's name as sglang serves it (``--served-model-name``, else the path)."""
    name = (getattr(server_args, "served_model_name", None)
            or getattr(server_args, "model_path", None))
    return str(name) if name else None


def mha_description(pool: Any, kv_args: Any, model: str) -> EngineDescription:
    """An ``MHATokenToKVPool`` (sglang's attribute names) and ``KVArgs`` as a whole
    ``sglang_mha`` config."""
    layout = str(getattr(pool, "kv_cache_layout", NHD))
    if layout != NHD:
        raise ConfigError(f"sglang's KV cache layout is {layout}: kvbeam moves the {NHD} "
                          "layout only (unset SGLANG_USE_HND_KVCACHE)")
    v_head_dim = getattr(pool, "v_head_dim", pool.head_dim)
    if v_head_dim != pool.head_dim:
        raise ConfigError(f"sglang's pool has V head dim {v_head_dim} beside K head dim "
                          f"{pool.head_dim}: kvbeam's sglang_mha kind needs them equal")
    aux_items, aux_rows = metadata_rows(kv_args)
    spec = sglang_mha_spec(num_layers=int(pool.layer_num), page_size=int(pool.page_size),
                           num_kv_heads=int(pool.head_num), head_dim=int(pool.head_dim),
                           dtype=torch_dtype_name(pool.dtype),
                           token_rows=int(pool.size) + int(pool.page_size),
                           aux_item_lens=aux_items, aux_rows=aux_rows,
                           max_inflight=aux_rows)
    config = SideConfig(model=model, target=spec, source="sglang's pools")
    derived = {f"target.{f.name}": getattr(spec, f.name) for f in fields(PoolSpec)}
    return EngineDescription({"model": model, **derived}, config,
                             f"sglang's {type(pool).__name__} and KVArgs")


def dsv4_fields(pool: Any) -> dict[str, Any]:
    """What sglang's ``setup_state_kv_args`` reads of a ``DeepSeekV4TokenToKVPool`` for its
    target/draft checks, under kvbeam's names (``ring_size`` and ``swa_pages`` are the
    spec's derived geometry)."""
    unified = bool(pool._unified_kv)
    out: dict[str, Any] = {
        "compression_ratios": tuple(int(r) for r in pool.compression_ratios),
        "unified_kv": unified, "page_size": int(pool.page_size)}
    if unified:
        out.update(sliding_window=int(pool.unified_swa_window),
                   ring_size=int(pool.unified_swa_ring_size),
                   swa_pages=int(pool.unified_swa_pages))
    else:
        out["sliding_window"] = int(pool.sliding_window)
    return out


def dsv4_description(target: Any, draft: Any | None) -> EngineDescription:
    """A DeepSeek-V4 target pool (and its NextN draft's) as the fields kvbeam checks."""
    derived = {f"target.{k}": v for k, v in dsv4_fields(target).items()}
    if draft is not None:
        derived.update({f"draft.{k}": v for k, v in dsv4_fields(draft).items()})
    return EngineDescription(derived, None, f"sglang's {type(target).__name__}")


def engine_description(target: tuple[Any, str] | None, draft: tuple[Any, str] | None,
                       kv_args: Any, model: str | None) -> EngineDescription | None:
    """The description of the pools ``KVArgs`` points at (``target``/``draft``: the pool
    objects and their kinds, :func:`kvbeam.integrations.sglang.memory.pools_for`); None
    when no sglang pool matched.

    Raises:
        ConfigError: sglang's pools are ones kvbeam cannot move (another layout, an
            unknown dtype, an MHA draft pool, ...).
    """
    if target is None:
        return None
    pool, kind = target
    if kind == "sglang_mha":
        if draft is not None:
            raise ConfigError("sglang's server has a speculative draft KV pool beside its "
                              "MHA pool: kvbeam's sglang_mha kind moves no draft pool "
                              "(run without --speculative-algorithm)")
        return mha_description(pool, kv_args, model or "sglang")
    if draft is not None and draft[1] != "dsv4":
        raise ConfigError(f"sglang's draft pool is {type(draft[0]).__name__} beside a "
                          "DeepSeek-V4 target: kvbeam moves a DeepSeek-V4 NextN draft only")
    return dsv4_description(pool, None if draft is None else draft[0])


def _value(config: SideConfig, path: str) -> Any:
    if path == "model":
        return config.model
    pool, _, name = path.partition(".")
    spec = config.target if pool == "target" else config.draft
    return None if spec is None else getattr(spec, name)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value)


def file_differences(engine: EngineDescription, given: SideConfig) -> list[str]:
    """Each derived field the side YAML gives otherwise: field, both values, the setting."""
    out = []
    draft_read = any(p.startswith("draft.") for p in engine.derived)
    if engine.config is not None or draft_read:
        has = engine.config.draft is not None if engine.config is not None else draft_read
        if (given.draft is not None) != has:
            out.append(f"draft: {given.source} {'has' if given.draft else 'has no'} draft "
                       f"pool, sglang's server {'has' if has else 'has none'} "
                       f"({setting_for('draft')})")
    for path, value in engine.derived.items():
        theirs = _value(given, path)
        if theirs is not None and theirs != value:
            out.append(f"{path}: {given.source} says {_show(theirs)}, sglang's server has "
                       f"{_show(value)} ({setting_for(path.partition('.')[2] or path)})")
    return out


def reconcile(engine: EngineDescription | None, given: SideConfig | None,
              role: str) -> SideConfig:
    """The side config the backend attaches with.

    The engine's when it was read whole (a given YAML must then equal it), else the
    YAML after the fields read from sglang were checked against it.

    Raises:
        ConfigError: a field of the YAML differs from sglang's (every one is named, with
            both values and the sglang setting), or nothing describes the pools.
    """
    if engine is None:
        if given is None:
            raise ConfigError("kvbeam sglang backend: no sglang pool object matches KVArgs "
                              "(not an MHATokenToKVPool or DeepSeekV4TokenToKVPool sglang "
                              "allocated), so nothing describes the pools: set "
                              "KVBEAM_CONFIG (the side YAML)")
        log.warning("kvbeam sglang backend (%s): KVArgs points at memory no sglang pool "
                    "object describes; the pools are taken as %s describes them", role,
                    given.source)
        return given
    if given is not None:
        diffs = file_differences(engine, given)
        if diffs:
            raise ConfigError(f"kvbeam sglang backend ({role}): {given.source} (KVBEAM_CONFIG) "
                              f"differs from {engine.source}: " + "; ".join(diffs)
                              + " (leave KVBEAM_CONFIG unset: the backend reads the pools "
                              "from sglang)")
    if engine.config is not None:
        return engine.config
    if given is None:
        raise ConfigError(f"kvbeam sglang backend ({role}): {engine.source} gives only "
                          f"{', '.join(engine.derived)}; set KVBEAM_CONFIG (the side YAML) "
                          "for the rest (they are checked against sglang's)")
    return given


def peer_differences(prefill: SideConfig, decode: SideConfig, prefill_where: str
                     ) -> list[str]:
    """Every difference the daemons' handshake would refuse between the two servers'
    pools (:func:`~kvbeam.pools.checks.compare_sides`), each with the sglang setting that
    decides it; empty when they may pair."""
    try:
        diffs: Sequence[Difference] = compare_sides(build_side_layout(prefill),
                                                    build_side_layout(decode))
    except KvbeamError as exc:  # a description the layout code refuses
        return [f"prefill's pools ({prefill_where}) cannot be laid out here: {exc}"]
    return [f"{d.message} ({setting_for(d.field)})" for d in diffs]
