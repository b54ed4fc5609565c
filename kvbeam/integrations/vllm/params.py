"""What travels with a vLLM request for kvbeam, and the connector's settings. No vLLM import.

vLLM's P/D contract (NixlConnector's, which every proxy written to it follows: vLLM's
toy proxy, vllm-router, llm-d's sidecar): the proxy sends prefill the request with
``max_tokens`` 1 and ``kv_transfer_params`` ``{"do_remote_decode": true, ...}``, the
same X-Request-Id to both servers, then decode the request with the
``kv_transfer_params`` prefill returned, unchanged. That is all kvbeam needs:

- to prefill: ``{"do_remote_decode": true}`` (NIXL's other keys are not read). Prefill
  names the transfer itself: its vLLM request id (``cmpl-<X-Request-Id>-<i>-<hex>``:
  the client-visible id is in it), and sends it to whichever decode's daemon reserves
  that id (its daemon waits for decode's Offer: a Send with no decode address). Its
  finished output carries
- back: ``{"do_remote_prefill": true, "kvbeam_id": ID, "prefill_daemon": ADDR,
  "prompt_len": N, "kvbeam_send_tp": T}``, which the proxy passes to decode's request
  (same prompt). Decode reserves its own blocks for the request on its daemon, naming
  prefill's daemon (whose daemon decode's reaches, connecting the pair when needed);
  the bytes land there; decode computes only the last prompt token again and generates.

A proxy of one's own may still name the transfer and decode's daemon (``kvbeam_id``,
``decode_daemon``); behind vllm-router, prefill's ``decode_daemons`` setting may map
the decode server the router names in its request id to its daemon. Both send to that
daemon directly (prefill dials it); neither is needed.

The block ids are each instance's own: prefill's go into its Send as the source
``KV_PAGES`` list, decode's into its Reserve as the destination list; kvbeam pairs
them by position (docs/indices.md).

Tensor parallelism: every TP rank's worker attaches to a daemon of its own, so an
instance of TP size N names N daemons (``decode_daemon`` and ``prefill_daemon`` are then
lists, rank order; a string is one rank). Prefill rank p sends one kvbeam transfer to
each decode rank d it holds the heads of (:func:`decode_ranks_of`), named
:func:`rank_transfer_id`; decode rank d reserves that id at the prefill rank that holds
its heads (:func:`prefill_rank_of`). Without a decode address prefill cannot know
decode's TP: it sends for a decode of its own TP (``kvbeam_send_tp``), and a decode of
another TP declines.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbeam.auth import CLIENT_SETTINGS
from kvbeam.errors import ConfigError

log = logging.getLogger(__name__)

#: The keys kvbeam reads from and writes into ``kv_transfer_params``.
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
KVBEAM_ID = "kvbeam_id"
DECODE_DAEMON = "decode_daemon"
PREFILL_DAEMON = "prefill_daemon"
PROMPT_LEN = "prompt_len"
#: Prefill named no decode: it sent for a decode of this TP size (its own).
SEND_TP = "kvbeam_send_tp"
#: Every ``kvbeam_``-prefixed key the connector reads; any other one is ignored (logged).
KNOWN_KVBEAM_KEYS = frozenset({KVBEAM_ID, SEND_TP})
#: The request id vllm-router's PD mode gives both servers (its ``X-Request-Id``, which
#: vLLM wraps as ``cmpl-<id>-<prompt>-<hex>``): the chosen prefill's and decode's HTTP
#: host:port and a uuid. vLLM's own MoRI-IO connector reads its peer from it the same way.
ROUTER_REQUEST_ID = re.compile(
    r"___prefill_addr_(?P<prefill>.+?)___decode_addr_(?P<decode>.+)_[0-9a-f]{32}(?:-.*)?$")


@dataclass(frozen=True)
class SendParams:
    """Prefill's instructions: push this request's prompt KV to ``decode_daemons`` (one
    per decode TP rank, rank order), or, with none, to whichever decode daemon reserves
    it (each prefill rank sends its own share for a decode of prefill's TP size)."""

    kvbeam_id: str
    decode_daemons: tuple[str, ...] = ()
    #: A decode server vllm-router named in the request id that ``decode_daemons`` (the
    #: setting) does not map: the send names no decode instead (logged, counted).
    unmapped: str = ""


@dataclass(frozen=True)
class LoadParams:
    """Decode's instructions: this request's prompt KV comes from ``prefill_daemons`` (one
    per prefill TP rank, rank order)."""

    kvbeam_id: str
    prefill_daemons: tuple[str, ...]
    #: The prompt length prefill computed (its returned ``prompt_len``; 0: not given).
    prompt_len: int = 0
    #: Prefill named no decode and sent for a decode of this TP size (0: it named one).
    send_tp: int = 0


#: The most TP ranks a daemon list may name (a bound on what a request may ask for).
MAX_RANKS = 256


def _text(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_transfer_params.{key}: a non-empty string is needed (got {value!r})")
    return value


def daemon_list(value: Any) -> tuple[str, ...] | None:
    """A daemon address (one TP rank) or a list of them (one per rank, rank order) as a
    tuple, or None when ``value`` is neither (empty, non-strings, over MAX_RANKS)."""
    if isinstance(value, str):
        return (value,) if value else None
    if (isinstance(value, list | tuple) and 0 < len(value) <= MAX_RANKS
            and all(isinstance(v, str) and v for v in value)):
        return tuple(value)
    return None


def _daemons(params: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = params.get(key)
    got = daemon_list(value)
    if got is None:
        raise ValueError(f"kv_transfer_params.{key}: a daemon address or a list of them (one "
                         f"per TP rank) is needed (got {value!r})")
    return got


def _one_or_list(daemons: tuple[str, ...]) -> str | list[str]:
    """How ``kv_transfer_params`` carries daemons: a string for one rank (as before TP)."""
    return daemons[0] if len(daemons) == 1 else list(daemons)


def rank_transfer_id(kvbeam_id: str, decode_rank: int, decode_tp: int) -> str:
    """The kvbeam transfer id of decode rank ``decode_rank``'s share of a request: the
    request's own for a TP 1 decode, else ``<kvbeam_id>.r<rank>``."""
    return kvbeam_id if decode_tp == 1 else f"{kvbeam_id}.r{decode_rank}"


def prefill_rank_of(decode_rank: int, decode_tp: int, prefill_tp: int) -> int:
    """The prefill rank that holds decode rank ``decode_rank``'s KV heads (heads split
    evenly over each instance's ranks)."""
    return decode_rank * prefill_tp // decode_tp


def decode_ranks_of(prefill_rank: int, prefill_tp: int, decode_tp: int) -> range:
    """The decode ranks whose heads prefill rank ``prefill_rank`` holds (those for which
    :func:`prefill_rank_of` names it). With prefill TP above decode TP only some prefill
    ranks send, and the daemons' handshake refuses the pair (docs/vllm.md)."""
    return range(-(-prefill_rank * decode_tp // prefill_tp),
                 -(-(prefill_rank + 1) * decode_tp // prefill_tp))


def _ignore_unknown(params: Mapping[str, Any]) -> None:
    """Log the ``kvbeam_`` keys kvbeam does not read, and read nothing of them.

    ``kv_transfer_params`` arrives from whoever calls vLLM's API. Ignored rather than
    refused: vLLM calls the connector inside its scheduler loop, where an exception
    stops the engine for every request, and the dict also carries the keys of other
    connectors and of the proxy (only ``kvbeam_`` ones are ours to name).
    """
    unknown = sorted(k for k in params if isinstance(k, str) and k.startswith("kvbeam_")
                     and k not in KNOWN_KVBEAM_KEYS)
    if unknown:
        log.warning("kv_transfer_params: unknown kvbeam key(s) %s ignored (kvbeam reads "
                    "%s); no request parameter switches test behaviour on",
                    ", ".join(unknown), ", ".join(sorted(KNOWN_KVBEAM_KEYS)))


def router_decode(request_id: str) -> str | None:
    """The decode server's HTTP host:port vllm-router named in ``request_id``, or None."""
    m = ROUTER_REQUEST_ID.search(request_id)
    return m.group("decode") if m else None


def send_params(params: Mapping[str, Any] | None, request_id: str = "",
                decode_daemons: Mapping[str, tuple[str, ...]] | None = None
                ) -> SendParams | None:
    """The send a prefill request asks for (``do_remote_decode``), or None.

    The transfer is ``kvbeam_id`` where given, else this request's vLLM id (unique, and
    returned to decode). Its decode daemons: ``decode_daemon`` where given (a proxy of
    one's own); behind vllm-router, the daemons ``decode_daemons`` maps the decode
    server named in the request id to; else none: the decode that reserves the
    transfer gets it (every proxy that speaks vLLM's contract).

    Raises:
        ValueError: ``decode_daemon`` or ``kvbeam_id`` is given but malformed.
    """
    if not params or not params.get(DO_REMOTE_DECODE):
        return None
    _ignore_unknown(params)
    if DECODE_DAEMON in params:
        return SendParams(_text(params, KVBEAM_ID), _daemons(params, DECODE_DAEMON))
    kvbeam_id = params.get(KVBEAM_ID) or request_id
    if not isinstance(kvbeam_id, str) or not kvbeam_id:
        raise ValueError(f"kv_transfer_params.{KVBEAM_ID}: a non-empty string is needed "
                         f"(got {kvbeam_id!r})")
    decode = router_decode(request_id)
    if decode is None or not decode_daemons:
        return SendParams(kvbeam_id)
    daemons = decode_daemons.get(decode)
    return SendParams(kvbeam_id, daemons) if daemons else SendParams(kvbeam_id,
                                                                     unmapped=decode)


def load_params(params: Mapping[str, Any] | None) -> LoadParams | None:
    """The load a decode request asks for, or None."""
    if not params or not params.get(DO_REMOTE_PREFILL):
        return None
    _ignore_unknown(params)
    prompt_len = params.get(PROMPT_LEN, 0)
    if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 0:
        raise ValueError(f"kv_transfer_params.{PROMPT_LEN}: a token count is needed "
                         f"(got {prompt_len!r})")
    send_tp = params.get(SEND_TP, 0)
    if not isinstance(send_tp, int) or isinstance(send_tp, bool) or not 0 <= send_tp <= MAX_RANKS:
        raise ValueError(f"kv_transfer_params.{SEND_TP}: a TP size is needed (got {send_tp!r})")
    return LoadParams(_text(params, KVBEAM_ID), _daemons(params, PREFILL_DAEMON), prompt_len,
                      send_tp)


def returned_params(kvbeam_id: str, prefill_daemons: tuple[str, ...], prompt_len: int,
                    *, named_decode: bool = True) -> dict[str, Any]:
    """What prefill's finished output carries for decode's request: every prefill rank's
    daemon (a string for one); ``named_decode`` False (prefill sent to whichever decode
    reserves it): the TP size it sent for, ``kvbeam_send_tp``."""
    out: dict[str, Any] = {DO_REMOTE_PREFILL: True, KVBEAM_ID: kvbeam_id,
                           PREFILL_DAEMON: _one_or_list(prefill_daemons),
                           PROMPT_LEN: prompt_len}
    if not named_decode:
        out[SEND_TP] = len(prefill_daemons)
    return out


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


#: The credential settings of the integrations that call daemons over gRPC
#: (:data:`kvbeam.auth.CLIENT_SETTINGS`). The vLLM connector makes no gRPC call, so it
#: refuses them rather than ignore a credential.
CREDENTIAL_KEYS = CLIENT_SETTINGS
#: Prompts shorter than this go whole even with ``layerwise`` (docs/vllm.md): on the
#: bench's 16-layer model a 512-token prompt's whole transfer took 27-40 ms, and its
#: pieces saved 8-13 ms after the prompt but cost its own forward about as much on a
#: 2-core host (TTFT -14 to +7 ms in three runs); a 4k-token prompt's saved 74 ms.
LAYERWISE_MIN_TOKENS = 1024
SETTINGS_KEYS = frozenset({"daemon", "attach_socket", "model", "inner_layout",
                           "decode_daemons", "staging", "staging_requests", "staging_tokens",
                           "staging_wait_s", "layerwise", "layerwise_min_tokens"})


@dataclass(frozen=True)
class Staging:
    """How the worker stages vLLM's KV cache through a host buffer (docs/vllm.md,
    "Staging"): ``enabled`` None stages exactly when the cache is not on the CPU (a
    GPU's: the daemon cannot map it); True stages a CPU cache too (its ordinary tensors
    stay where vLLM put them); False never stages (refused for a GPU cache). The buffer
    holds ``requests`` requests of ``tokens`` tokens (0: vLLM's ``max_model_len``), and a
    request waits up to ``wait_s`` for room."""

    enabled: bool | None = None
    requests: int = 4
    tokens: int = 0
    wait_s: float = 5.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> Staging:
        """The ``staging*`` keys of ``kv_connector_extra_config``.

        Raises:
            ConfigError: a value of the wrong type or out of range, naming the key.
        """
        enabled = extra.get("staging")
        if enabled is not None and not isinstance(enabled, bool):
            raise ConfigError(f"kv_connector_extra_config.staging: true or false (got "
                              f"{enabled!r}); leave it out to stage exactly when vLLM's KV "
                              "cache is not on the CPU")
        values: dict[str, Any] = {}
        for key, low in (("requests", 1), ("tokens", 1)):
            value = extra.get(f"staging_{key}")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"kv_connector_extra_config.staging_{key}: a whole number "
                                  f">= {low} is needed (got {value!r})")
            values[key] = value
        wait = extra.get("staging_wait_s")
        if wait is not None:
            if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
                raise ConfigError("kv_connector_extra_config.staging_wait_s: seconds >= 0 "
                                  f"are needed (got {wait!r})")
            values["wait_s"] = float(wait)
        return cls(enabled, **values)


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``: where this instance's kvbeam daemon is.

    The connector's every call goes over the attach socket's engine channel (the daemon
    admits the engine by its uid): it makes no gRPC call and holds no credentials. The
    daemons authenticate each other with their own flags (``--auth-token-file``,
    ``--tls-*``).

    Attributes:
        daemons: each TP rank's local daemon's gRPC address (``--listen``), rank order
            (``daemon``: a string for TP 1, a list of one per rank): not called by the
            connector, but handed to decode (prefill's ``prefill_daemon``), whose daemons
            reach prefill's there.
        attach_sockets: each rank's daemon's ``--attach-socket`` (``attach_socket``, as
            ``daemon``): rank r's worker attaches its share of vLLM's KV cache there and
            drives its transfers over it (a daemon attaches one engine).
        model: the model name both sides' pool metadata must share (default: vLLM's
            served model name).
        inner_layout: the name of vLLM's block layout both sides must share; "" (the
            default): read from the KV cache's strides (vLLM CPU: ``LBHNC``), and a
            value given must match them.
        decode_daemons: optional, prefill behind vllm-router: each decode server's
            HTTP host:port (as the router's ``--decode`` URL names it) -> that server's
            kvbeam daemon, or a list of its ranks' daemons for a TP > 1 decode: prefill
            then dials that daemon itself (docs/vllm.md, "Behind vllm-router"). Not
            needed: without it the decode that reserves a transfer gets it.
        staging: ``staging``, ``staging_requests``, ``staging_tokens``,
            ``staging_wait_s``: the KV cache staged through a host buffer
            (:class:`Staging`).
        layerwise: ``layerwise`` (prefill; default false): send a finishing prompt's
            blocks layer by layer as vLLM computes them (``save_kv_layer``), so only the
            last layer's transfer follows the prompt's end; for a request whose decode
            is named (``decode_daemon``, or ``decode_daemons`` behind vllm-router) and
            a cache that is not staged; others go whole (docs/vllm.md, "Layer by
            layer").
        layerwise_min_tokens: ``layerwise_min_tokens`` (default
            :data:`LAYERWISE_MIN_TOKENS`): shorter prompts go whole, their transfer being
            shorter than what the pieces cost the prompt's own forward.
    """

    daemons: tuple[str, ...]
    attach_sockets: tuple[str, ...]
    model: str
    inner_layout: str = ""
    decode_daemons: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    staging: Staging = field(default_factory=Staging)
    layerwise: bool = False
    layerwise_min_tokens: int = LAYERWISE_MIN_TOKENS

    def check_tp(self, tp_size: int) -> None:
        """Refuse settings that do not name one daemon and attach socket per TP rank.

        Raises:
            ConfigError: naming both counts.
        """
        for key, values in (("daemon", self.daemons), ("attach_socket", self.attach_sockets)):
            if len(values) != tp_size:
                raise ConfigError(
                    f"kv_connector_extra_config.{key}: {len(values)} given for "
                    f"tensor_parallel_size {tp_size}: each TP rank attaches to a daemon of "
                    f"its own (a daemon attaches one engine), so give a list of {tp_size}, "
                    "rank order (docs/vllm.md, \"Tensor parallelism\")")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], default_model: str) -> Settings:
        """Read and check the connector's extra config.

        Raises:
            ConfigError: a key is unknown, a credential key is given (naming where the
                credentials go instead), or ``daemon``/``attach_socket`` is missing.
        """
        credentials = [k for k in CREDENTIAL_KEYS if k in extra]
        if credentials:
            raise ConfigError(
                f"kv_connector_extra_config: {', '.join(credentials)}: the connector makes "
                "no gRPC call, so it takes no credentials: its calls go over the attach "
                "socket (attach_socket), where the daemon checks the engine's uid "
                "(--attach-allow-uid); give the token or TLS files to the daemons "
                "themselves (--auth-token-file; --tls-cert, --tls-key, --tls-ca)")
        unknown = sorted(set(extra) - SETTINGS_KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(SETTINGS_KEYS))}")
        lists: dict[str, tuple[str, ...]] = {}
        for key in ("daemon", "attach_socket"):
            got = daemon_list(extra.get(key))
            if got is None:
                raise ConfigError(f"kv_connector_extra_config.{key}: required (a string, or "
                                  "a list of one per TP rank; got "
                                  f"{extra.get(key)!r})")
            lists[key] = got
        if len(lists["daemon"]) != len(lists["attach_socket"]):
            raise ConfigError(
                f"kv_connector_extra_config: daemon names {len(lists['daemon'])} daemon(s), "
                f"attach_socket {len(lists['attach_socket'])}: one of each per TP rank")
        layerwise = extra.get("layerwise", False)
        if not isinstance(layerwise, bool):
            raise ConfigError(f"kv_connector_extra_config.layerwise: true or false (got "
                              f"{layerwise!r})")
        min_tokens = extra.get("layerwise_min_tokens", LAYERWISE_MIN_TOKENS)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ConfigError("kv_connector_extra_config.layerwise_min_tokens: a token count "
                              f">= 0 is needed (got {min_tokens!r})")
        return cls(daemons=lists["daemon"], attach_sockets=lists["attach_socket"],
                   model=str(extra.get("model") or default_model),
                   inner_layout=str(extra.get("inner_layout") or ""),
                   decode_daemons=_decode_daemons(extra.get("decode_daemons") or {}),
                   staging=Staging.from_extra(extra), layerwise=layerwise,
                   layerwise_min_tokens=min_tokens)


def _decode_daemons(value: Any) -> dict[str, tuple[str, ...]]:
    """``decode_daemons`` with its keys as vllm-router names them (host:port, no scheme),
    each value a decode server's daemon or its TP ranks' daemons."""
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and k and daemon_list(v) is not None for k, v in value.items()):
        raise ConfigError("kv_connector_extra_config.decode_daemons: a mapping of decode vLLM "
                          "HTTP addresses (host:port, as vllm-router's --decode names them) "
                          "to their kvbeam daemons' addresses (a list of one per TP rank for "
                          f"a TP > 1 decode) is needed (got {value!r})")
    out: dict[str, tuple[str, ...]] = {}
    for k, v in value.items():
        daemons = daemon_list(v)
        assert daemons is not None  # checked above
        out[re.sub(r"^https?://", "", k).rstrip("/")] = daemons
    return out
