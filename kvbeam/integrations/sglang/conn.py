"""kvbeam as an sglang transfer backend: manager, sender, receiver, bootstrap server.

Subclasses of sglang's own base classes (``sglang.srt.disaggregation.base.conn``,
sglang 0.5.23) on :mod:`kvbeam.engine`. Each server process runs a kvbeam daemon
beside it (``kvbeam prefill|decode --pools engine --attach-socket PATH``); the
manager attaches the engine's pools that ``KVArgs`` points at, the daemons move the
bytes. docs/sglang.md.

Every per-request call goes over the engine channel of the manager's attachment
(:mod:`kvbeam.engine.channel`): decode's ``send_metadata`` is a RESERVE frame to its own
daemon (which offers the reservation to prefill's over the daemons' peer link), each of
prefill's ``send`` calls a SEND frame to its own with that chunk's pages (written while
sglang computes the next chunk), ``abort``/``clear`` ABORT/RELEASE frames, and
``poll()`` reads the state the daemon pushed. The bootstrap room (plain TCP) still tells
each side the other's daemon address, and prefill decode's request length. No gRPC
call per request, and no gRPC import (tests/host/test_sglang_auth.py).

The pools' description (the side config the attach carries and the daemons compare) is
read from sglang's own pool objects (:mod:`kvbeam.integrations.sglang.describe`), never
trusted from a file.

Staged (:mod:`kvbeam.integrations.sglang.staged`: a pool on a GPU, or ``KVBEAM_STAGING=1``)
the manager attaches a host staging buffer of the pools' geometry instead: prefill's
last ``send`` gathers the request's pages, states and metadata row into staging items
and sends them in one SEND once the copy completed (earlier chunks are not sent on their
own); decode reserves staging items, and its poll scatters them into sglang's pool and
metadata rows after Success, saying Success only once that copy completed. A full
buffer makes a request wait (asked again at each poll) up to ``KVBEAM_STAGING_WAIT_S``,
then fails it; its staging items go back at every end.

Every request ends: a side that gives a request up leaves its cause in the bootstrap
room (a tombstone the store forgets once both deadlines below passed), so the other
side's poll ends at once with that cause; and each request has sglang's own deadlines
from the moment it exists (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` until decode
reserved, ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` from then to its end).

Settings (attributes of sglang's ``server_args`` when present, else environment):
``kvbeam_config`` / ``KVBEAM_CONFIG`` (optional: a side YAML checked against the pools
read from sglang),
``kvbeam_daemon`` / ``KVBEAM_DAEMON`` (its gRPC address, which the peer daemon is
told), ``kvbeam_attach_socket`` / ``KVBEAM_ATTACH_SOCKET``; credentials, the daemons'
flags of the same names (:data:`kvbeam.auth.CLIENT_SETTINGS`): ``kvbeam_auth_token_file``
/ ``KVBEAM_AUTH_TOKEN_FILE``, ``kvbeam_tls_cert`` / ``KVBEAM_TLS_CERT``, ``..._tls_key``,
``..._tls_ca``, ``..._tls_server_name``. Every bootstrap store request carries the
token, and the store requires it (sglang builds the store from host and port only, so
there the environment's ``KVBEAM_AUTH_TOKEN_FILE`` counts). ``kvbeam_stream_chunks`` /
``KVBEAM_STREAM_CHUNKS`` (prefill; default on): on, each chunk's pages are sent as
sglang hands them over; off, the whole request goes in one SEND at its last chunk
(:func:`stream_chunks_setting`; staged requests always go whole).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from kvbeam.auth import (
    CLIENT_SETTINGS,
    Security,
    client_security,
    insecure_from_environment,
    parse_bool,
)
from kvbeam.engine import Attachment, EngineBuffers, EnginePools, Receiver, Sender, attach
from kvbeam.engine.requests import KVPoll
from kvbeam.engine.staging import StagedRequest, StagingBuffer, TensorKV
from kvbeam.errors import AttachError, ConfigError, KvbeamError, PoolCompatibilityError
from kvbeam.integrations.sglang import bootstrap, memory, staged
from kvbeam.integrations.sglang.describe import (
    engine_description,
    model_name,
    peer_differences,
    reconcile,
)
from kvbeam.integrations.sglang.kvargs import (
    buffers_from_kvargs,
    check_kvargs,
    state_index_lists,
)
from kvbeam.integrations.sglang.scheduler import (
    PREFILL_KEY,
    ManagerMembers,
    ReceiverMembers,
    aux_lists,
    decode_poll,
    decode_seq_len,
    prefill_poll,
    same_lists,
)
from kvbeam.pools.checks import check_target_draft
from kvbeam.pools.indices import expected_lengths
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.spec import SideConfig, load_side_config
from kvbeam.pools.types import IndexKind
from kvbeam.proto.attach_codec import config_to_mapping
from kvbeam.states import FailureReason

try:
    from sglang.srt.disaggregation.base.conn import (
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVTransferMetric,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvbeam.integrations.sglang needs sglang 0.5.23 (`make sglang`, or "
        f"`pip install --no-deps -r requirements-sglang.txt`): {exc}") from exc

log = logging.getLogger(__name__)
__all__ = ["PREFILL_KEY", "KvbeamKVBootstrapServer", "KvbeamKVManager", "KvbeamKVReceiver",
           "KvbeamKVSender"]


def _optional(server_args: Any, name: str) -> str:
    return str(getattr(server_args, name, None) or os.environ.get(name.upper()) or "")


def _setting(server_args: Any, name: str) -> str:
    value = _optional(server_args, name)
    if not value:
        raise RuntimeError(f"kvbeam sglang backend: set server_args.{name} or {name.upper()}")
    return value


#: The per-chunk streaming setting: ``server_args.kvbeam_stream_chunks``, else this
#: environment variable.
STREAM_CHUNKS_ENV = "KVBEAM_STREAM_CHUNKS"


def stream_chunks_setting(server_args: Any = None) -> bool:
    """``kvbeam_stream_chunks`` / ``KVBEAM_STREAM_CHUNKS``: True (unset, the default) when
    prefill sends each chunk's pages as sglang hands them over (``KVSender.send``), so
    they move while sglang computes the next chunk; False when it sends the whole request
    once, in one SEND at the last chunk (nothing moves before the prompt's end). Read
    as the daemons read a boolean (1/true/yes/on, 0/false/no/off); a server_args
    attribute that is set (not None) wins over the environment.

    Raises:
        ConfigError: any other value, naming the setting.
    """
    value = getattr(server_args, "kvbeam_stream_chunks", None)
    where = "server_args.kvbeam_stream_chunks" if value is not None else STREAM_CHUNKS_ENV
    text = str(value if value is not None else os.environ.get(STREAM_CHUNKS_ENV, "")).strip()
    if not text:
        return True
    try:
        return parse_bool(text)
    except ValueError:
        raise ConfigError(
            f"kvbeam sglang backend: {where}={text!r}: 1/true/yes/on sends each prefill "
            "chunk as sglang hands it over (the default), 0/false/no/off sends the whole "
            "request once, at its last chunk") from None


def sglang_timeout(name: str, default: float = 300.0) -> float:
    """One of sglang's disaggregation deadlines (``SGLANG_DISAGGREGATION_*_TIMEOUT``),
    seconds, as sglang's own backends read it."""
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except (ImportError, AttributeError):  # an sglang without the setting: its default
        return float(os.environ.get(name) or default)
    except ValueError as exc:
        raise ConfigError(f"kvbeam sglang backend: {name}: {exc}") from exc


def credentials(server_args: Any) -> Security:
    """What the backend presents to daemons: ``server_args.kvbeam_KEY``, else ``KVBEAM_KEY``
    from the environment, for each of :data:`~kvbeam.auth.CLIENT_SETTINGS` (files read now)."""
    values = {key: getattr(server_args, f"kvbeam_{key}", None)
              or os.environ.get(f"KVBEAM_{key.upper()}") for key in CLIENT_SETTINGS}
    return client_security(values, "kvbeam sglang backend")


#: Seconds between decode's bootstrap-store reads while its reservation reads
#: Bootstrapping (a prefill that gave the request up before sending tells decode only
#: through the room). Attached with ``pushes="final"``, that lasts until the request ends:
#: a transfer of milliseconds costs at most one read.
ROOM_CHECK_S = 0.5


def _room_key(room: Any) -> str:
    return f"room.{room}"


#: Distinct prefill descriptions a decode manager remembers the comparison of.
PEER_CHECKS = 64
#: Seconds between two warnings about one bootstrap store that cannot answer a poll.
STORE_WARN_S = 10.0


class KvbeamKVManager(ManagerMembers, BaseKVManager):  # type: ignore[misc]
    """One per server: checks the pools ``KVArgs`` describes and attaches them.

    The pools' description is read from sglang's pool objects that ``KVArgs`` points at
    (:mod:`~kvbeam.integrations.sglang.describe`); ``KVBEAM_CONFIG``, when set, must
    agree with it.

    Raises (at construction, before anything is attached):
        ConfigError: a field of ``KVBEAM_CONFIG`` differs from sglang's pools (each named
            with both values and the sglang setting), sglang's pools are ones kvbeam
            cannot move, or ``KVBEAM_STREAM_CHUNKS`` is not a boolean.
        RuntimeError: sglang's DSV4 target/draft checks failed, with sglang's wording
            ("DSV4 target and draft pools must use the same unified-KV mode: ...").
        AttachError: ``KVArgs`` does not match the description, is not in shareable
            memory, or the daemon refused the attach.
    """

    #: Staged: the host buffer the daemon maps, and sglang's pools as its device KV
    #: (None: the daemon maps sglang's pools themselves).
    staging: StagingBuffer | None = None
    device_kv: TensorKV | None = None
    #: Prefill: each chunk sent as sglang hands it over (True, the default), or the whole
    #: request once at its last chunk (False: ``KVBEAM_STREAM_CHUNKS=0``); staged
    #: requests always go whole.
    stream_chunks: bool = True

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.mode = str(getattr(disaggregation_mode, "value", disaggregation_mode))
        self.server_args = server_args
        self.stream_chunks = stream_chunks_setting(server_args)
        path = _optional(server_args, "kvbeam_config")
        given = load_side_config(path) if path else None
        target, draft = memory.pools_for(args)
        self.config = reconcile(engine_description(target, draft, args,
                                                   model_name(server_args)), given, self.mode)
        log.info("kvbeam sglang backend (%s): pools %s", self.mode,
                 json.dumps(config_to_mapping(self.config), separators=(",", ":")))
        self.layout = build_side_layout(self.config)
        try:
            check_target_draft(self.layout, self.mode)
        except PoolCompatibilityError as exc:
            raise RuntimeError(str(exc)) from exc
        check_kvargs(args, self.layout)
        self.security = credentials(server_args)
        self.daemon = _setting(server_args, "kvbeam_daemon")
        self.bootstrap_timeout = sglang_timeout("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
        self.waiting_timeout = sglang_timeout("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
        self.tombstone_ttl = self.bootstrap_timeout + self.waiting_timeout
        #: decode: prefill description (JSON) -> why it cannot pair with ours ("" : it can)
        self._peer_checks: dict[str, str] = {}
        #: bootstrap store -> when its next unreadable-store warning may be logged
        self._store_warned: dict[str, float] = {}
        self._init_scheduler_members()
        self.staging, self.device_kv = self._staging(target, server_args)
        self.staging_log = staged.StagingLog(self.mode)
        if self.mode == "prefill":
            if self.staging is not None:
                sends = "staged: each request sent whole, at its last chunk"
            elif self.stream_chunks:
                sends = "each chunk sent as sglang hands it over (KVBEAM_STREAM_CHUNKS on)"
            else:
                sends = "each request sent whole, at its last chunk (KVBEAM_STREAM_CHUNKS off)"
            log.info("kvbeam sglang backend (prefill): %s", sends)
        try:
            self.attachment = self._attach(_setting(server_args, "kvbeam_attach_socket"))
        except BaseException:
            if self.staging is not None:
                self.staging.close()
            raise
        if self.mode == "prefill" and getattr(server_args, "disaggregation_bootstrap_port",
                                              None) is not None:
            self.register_to_bootstrap()  # sglang's schedulers never call it for kvbeam

    def _staging(self, target: tuple[Any, str] | None, server_args: Any
                 ) -> tuple[StagingBuffer | None, TensorKV | None]:
        """The staging buffer and device KV when the pools are staged (a GPU pool, or
        asked for); (None, None) when the daemon maps sglang's pools themselves.

        Raises:
            ConfigError: staging refused (``KVBEAM_STAGING=0``) for a GPU pool, or asked
                for pools kvbeam does not stage (not sglang's MHA pool).
        """
        wanted = staged.staging_requested(server_args)
        pool = target[0] if target is not None and target[1] == memory.MHA else None
        tensors = (staged.pool_tensors(pool, memory.metadata_for(self.kv_args))
                   if pool is not None else [])
        device = staged.pool_device(tensors)
        if device == "cpu" and not wanted:
            return None, None
        if wanted is False:
            raise ConfigError(f"KVBEAM_STAGING=0, but sglang's KV pool is on {device}: a "
                              "kvbeam daemon maps host memory only, so a GPU pool moves "
                              "through a pinned host staging buffer; leave KVBEAM_STAGING "
                              "unset")
        if pool is None:
            raise ConfigError("staging: kvbeam stages sglang's MHA pool (and its metadata "
                              "rows) only; these pools are not one (docs/sglang.md)")
        kv = staged.device_kv(self.kv_args, self.layout, tensors)
        buffer = staged.staging_buffer(self.config, device, staged.Capacity.read(server_args))
        log.info("kvbeam sglang backend (%s): the pools stay on %s; staged through a host "
                 "buffer of %d request(s), %.1f MiB", self.mode, device,
                 buffer.config.target.num_req_slots, buffer.layout.total_bytes / 2**20)
        return buffer, kv

    def _attach(self, sock: str, timeout: float = 180.0) -> Attachment:
        memory_: EnginePools | EngineBuffers
        if self.staging is not None:
            memory_, config = self.staging.pools, self.staging.config
        else:
            memory_, config = buffers_from_kvargs(self.kv_args, self.layout), self.config
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    # Only a request's end is pushed: sglang's queues read every
                    # other daemon state as in progress (prefill_poll, decode_poll),
                    # and each push would wake the reader thread in sglang's scheduler.
                    # A restarted daemon gets the same memory again (reattach keeps
                    # duplicates of the fds closed below); meanwhile polls read Failed.
                    return attach(sock, memory_, config, pushes="final", reattach=True)
                except AttachError as exc:
                    # The daemon beside the server may still be starting (importing torch
                    # takes a minute under emulation): retry then only.
                    if not str(exc).startswith("cannot attach") or time.monotonic() > deadline:
                        raise
                time.sleep(0.1)
        finally:
            if isinstance(memory_, EngineBuffers):
                for fd in memory_.fds:
                    os.close(fd)

    def registration(self) -> dict[str, Any]:
        """What prefill publishes at its bootstrap server: its daemon and its pools."""
        return {"daemon": self.daemon, "config": config_to_mapping(self.config)}

    def detached_reason(self) -> str:
        """Why this manager's attachment can carry no request now ("" : it can)."""
        channel = self.attachment.channel
        if channel is None:
            return "" if self.attachment.attached else f"detached from {self.attachment.path}"
        return channel.closed_reason

    def peer_mismatch(self, prefill: Mapping[str, Any], where: str) -> str:
        """Decode: why prefill's pools (its registration at ``where``) cannot pair with
        ours, naming each difference and the sglang setting behind it ("" : they can).
        The same comparison as the daemons' handshake, made before anything is reserved."""
        mapping = prefill.get("config")
        if not isinstance(mapping, Mapping):
            return ""  # a prefill that publishes no description: the handshake decides
        key = json.dumps(mapping, sort_keys=True)
        if key not in self._peer_checks:
            try:
                theirs = SideConfig.from_mapping(mapping, f"prefill's pools ({where})")
                diffs = peer_differences(theirs, self.config, where)
            except ConfigError as exc:
                diffs = [str(exc)]
            why = ("" if not diffs else
                   f"kvbeam: the prefill server (bootstrap {where}) and this decode server "
                   "lay KV out differently, so nothing moves; start both with the same "
                   "settings: " + "; ".join(diffs))
            if why:
                log.error("%s", why)
            if len(self._peer_checks) >= PEER_CHECKS:
                self._peer_checks.clear()
            self._peer_checks[key] = why
        return self._peer_checks[key]

    def give_up(self, bootstrap_addr: str, room: Any, reason: str) -> None:
        """Tell the other side through the room that this request ends here, and why: a
        tombstone the store keeps for :attr:`tombstone_ttl` seconds, so the other side's
        poll ends with this cause whenever it looks (a deleted room would read as "not
        posted yet")."""
        try:
            self.store(bootstrap_addr, "put", _room_key(room),
                       {"aborted": True, "reason": reason}, ttl=self.tombstone_ttl)
        except (OSError, RuntimeError, KvbeamError) as exc:
            log.warning("kvbeam: room %s: could not tell the other side it ended (%s): %s",
                        room, reason, exc)

    def read(self, bootstrap_addr: str, key: str) -> Any:
        """A bootstrap-store read from a poll: None when the store cannot answer now (a
        warning per store at most every :data:`STORE_WARN_S`; the request's deadline
        still ends it), so no network error reaches sglang's scheduler loop.

        Raises:
            AuthenticationError: the store refused our credentials (the caller fails the
                request with it: no retry can succeed).
        """
        try:
            return self.store(bootstrap_addr, "get", key)
        except (OSError, RuntimeError) as exc:
            now = time.monotonic()
            if now >= self._store_warned.get(bootstrap_addr, 0.0):
                self._store_warned[bootstrap_addr] = now + STORE_WARN_S
                log.warning("kvbeam: bootstrap store %s: %s unread: %s", bootstrap_addr,
                            key, exc)
            return None

    def forget(self, bootstrap_addr: str, room: Any) -> None:
        """Delete a room whose request moved (a store that cannot answer: logged; the
        entry then stays until the store's server restarts)."""
        try:
            self.store(bootstrap_addr, "delete", _room_key(room))
        except (OSError, RuntimeError, KvbeamError) as exc:
            log.warning("kvbeam: bootstrap store %s: room %s not deleted: %s",
                        bootstrap_addr, room, exc)

    def store(self, address: str, op: str, key: str, value: Any = None,
              timeout: float = 10.0, ttl: float | None = None) -> Any:
        """One operation on the bootstrap store at ``address``, with our token."""
        return bootstrap.call(address, op, key, value, timeout, token=self.security.token,
                              ttl=ttl)

    def log_staging(self) -> None:
        """Staged: the staging buffer's figures in sglang's log, when due (polls call it)."""
        if self.staging is not None:
            self.staging_log.maybe(self.staging)

    def close(self) -> None:
        """Detach the engine's memory (the daemon fails its live requests); staged, free
        the staging buffer."""
        self.attachment.close()
        if self.staging is not None:
            self.staging.close()


class KvbeamKVSender(BaseKVSender):  # type: ignore[misc]
    """Prefill's side of one request (``bootstrap_room``), over the engine channel.

    Ends however the request goes: decode's tombstone in the room (read by every poll
    until decode's room appears, then at most once per :data:`ROOM_CHECK_S` while it
    moves), this side's daemon gone (a failed poll at once), or sglang's deadlines:
    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` from its creation until decode's room
    appears, ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` from then until it ends.
    """

    def __init__(self, mgr: KvbeamKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, bootstrap_room
        self.request_id = f"sglang-{bootstrap_room}"
        self.num_pages = 0
        self.aux_index: int | None = None
        self.pages: list[Any] = []
        self.tokens = 0
        self.seq_len: int | None = None  # decode's length, read at the first chunk
        self.request: Sender | None = None  # once sent: the channel's record of it
        self.decode_posted = False  # decode's room was seen (no more store reads in poll)
        self.withdrawn = False  # the room holds why this request ended (ours or decode's)
        self.error: str | None = None
        self.nbytes: int | None = None
        self.last: Any = None  # the failure as last seen (reason, detail), for messages
        self.deadline = time.monotonic() + mgr.bootstrap_timeout
        self.next_room_check = 0.0
        #: Staged: the request's way through the staging buffer, once its last chunk came.
        self.staged: StagedRequest | None = None
        self.staged_sent = False

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Remember how many pages the request has (the last chunk completes them) and
        its metadata row (``aux_index``)."""
        self.num_pages = num_kv_indices
        self.aux_index = aux_index

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None, **_: Any) -> None:
        """One chunk's pages, sent at once: a SEND frame that gives the daemon the KV
        pages this chunk adds (``Sender.send_chunk``), so its
        bytes move while sglang computes the next chunk. The last chunk (states given, or
        all pages) also carries the states and the metadata row; decode is Success once
        it landed and was verified.

        With ``KVBEAM_STREAM_CHUNKS`` off (:attr:`KvbeamKVManager.stream_chunks`), or
        staged, earlier chunks' pages are only remembered: the last chunk sends the
        whole request, every page with the states, in one SEND.
        """
        if num_kv_tokens is None:
            raise ValueError("kvbeam needs num_kv_tokens on every send (sglang >= 0.5.23)")
        if self.error is not None:
            return  # failed (or aborted) already: poll says Failed
        pages = [int(p) for p in kv_indices]
        self.pages.extend(pages)
        self.tokens += num_kv_tokens
        final = state_indices is not None or len(self.pages) >= self.num_pages
        try:
            if self.mgr.staging is not None:
                if final:  # staged: the whole request at once, from the staging items
                    self._stage(state_indices)
            elif self.mgr.stream_chunks:
                self._send_chunk(pages, final, state_indices)
            elif final:  # not streamed: the whole request at once, at its last chunk
                self._send_whole(state_indices)
        except (KvbeamError, RuntimeError, OSError, ValueError) as exc:
            self._fail(f"kvbeam send of {self.request_id} failed: {exc}")

    def _send_chunk(self, pages: list[int], final: bool,
                    state_indices: list[Any] | None) -> None:
        if self.request is None:
            self._start()
        assert self.request is not None and self.seq_len is not None
        seq_len, states = self.seq_len, None
        if final:
            states = self._final_lists(state_indices)
        # Decode's length is authoritative (it reserved with it; the lists are the same).
        # sglang's chunks end on a page boundary, so each gives only whole pages.
        self.request.send_chunk(pages, seq_len=seq_len, final=final, state_indices=states)

    def _send_whole(self, state_indices: list[Any] | None) -> None:
        """Not streamed: every page of the request and its states in one SEND frame."""
        if self.request is None:
            self._start()
        assert self.request is not None and self.seq_len is not None
        states = self._final_lists(state_indices)
        self.request.send(self.pages, states, seq_len=self.seq_len)

    def _final_lists(self, state_indices: list[Any] | None) -> dict[str, Any]:
        """The lists the last chunk brings (states, the metadata row), checked: prefill's
        token count needs the lists decode reserved."""
        assert self.seq_len is not None
        if not same_lists(self.mgr.config.target, self.mgr.layout, self.tokens, self.seq_len):
            raise RuntimeError(f"room {self.room}: prefill computed {self.tokens} tokens, "
                               f"decode reserved {self.seq_len}: their index lists differ")
        states = {**state_index_lists(self.mgr.layout, state_indices),
                  **aux_lists(self.mgr.layout, self.aux_index)}
        self.nbytes = moved_bytes(self.mgr.layout, {"KV_PAGES": self.pages, **states})
        return states

    def _stage(self, state_indices: list[Any] | None) -> None:
        """Staged, at the last chunk: a place in the staging buffer for the whole
        request's lists; the gather and the send follow (:meth:`_advance_staging`)."""
        if self.request is None:
            self._start()
        assert self.mgr.staging is not None
        lists = staged.device_lists({"KV_PAGES": self.pages,
                                     **self._final_lists(state_indices)})
        self.staged = StagedRequest(self.mgr.staging, lists)
        self._advance_staging()

    def _advance_staging(self) -> None:
        """Staging room came: gather (on CUDA on a side stream); the gather completed:
        send the request from its staging items, as one final chunk. Never waits."""
        assert self.staged is not None and self.mgr.device_kv is not None
        items = self.staged.gather(self.mgr.device_kv)
        if items is None or self.staged_sent:
            return
        assert self.request is not None and self.seq_len is not None
        lists = items.named_lists()
        self.request.send_chunk(lists.pop("KV_PAGES"), seq_len=self.seq_len, final=True,
                                state_indices=lists, kv_offset=0)
        self.staged_sent = True

    def _unstage(self) -> None:
        """The request ended: its staging items back (staged; idempotent)."""
        if self.staged is not None:
            self.staged.release()

    def _start(self) -> None:
        """At the first chunk: decode's daemon and length from the room (read again, not
        the cached sighting: decode may have given up since), checked against ours."""
        decode = self.mgr.store(self.bootstrap_addr, "get", _room_key(self.room))
        if not decode or decode.get("aborted"):
            self.withdrawn = bool(decode)  # decode's tombstone says why: keep it
            raise RuntimeError(_gave_up("decode", self.room, decode))
        seq_len = decode.get("seq_len")
        if not isinstance(seq_len, int) or not isinstance(decode.get("daemon"), str):
            raise RuntimeError(f"room {self.room}: decode's entry names no daemon and "
                               f"seq_len (a kvbeam older than the engine channel?): {decode}")
        want = expected_lengths(self.mgr.config.target, seq_len)[IndexKind.KV_PAGES]
        if self.num_pages != want:
            raise RuntimeError(
                f"room {self.room}: prefill has {self.num_pages} KV pages of "
                f"{self.mgr.config.target.page_size} tokens (--page-size), decode reserved "
                f"{want} for {seq_len} tokens: their index lists differ (start both servers "
                "with the same --page-size)")
        self.seq_len = seq_len
        self.request = Sender(self.mgr.attachment, self.request_id, decode["daemon"])

    def _fail(self, error: str) -> None:
        """End the request here: remember why, stop what moves, tell decode (once)."""
        if self.error is None:
            self.error = error
            log.error("%s", error)
        if self.request is not None and self.request.poll() not in (KVPoll.Success,
                                                                    KVPoll.Failed):
            self.request.abort(error)  # earlier chunks may be moving: stop them
        self._unstage()
        self._withdraw(error)

    def _withdraw(self, reason: str) -> None:
        """Leave why this request ended in the room (once): decode's poll ends with it."""
        if not self.withdrawn:
            self.withdrawn = True
            self.mgr.give_up(self.bootstrap_addr, self.room, reason)

    def poll(self) -> int:
        """Bootstrapping until decode sent its metadata, WaitingForInput, then the state
        the daemon pushed (an attribute read; a room read per :data:`ROOM_CHECK_S` at
        most). Its handshake reads Transferring: sglang's inflight queue takes no
        Bootstrapping."""
        if self.error is not None:
            return int(KVPoll.Failed)
        self.mgr.log_staging()
        now = time.monotonic()
        if self.staged is not None and not self.staged_sent:
            try:
                self._advance_staging()
            except (KvbeamError, RuntimeError, OSError, ValueError) as exc:
                self._fail(f"kvbeam send of {self.request_id} failed: {exc}")
                return int(KVPoll.Failed)
        if self.request is not None:
            state = int(self.request.poll())
            if state in (int(KVPoll.Success), int(KVPoll.Failed)):
                self._unstage()
            if state == int(KVPoll.Failed):
                self.last = self.request.failure()
                self._withdraw(_failure_text(self.request_id, self.last))
            elif state != int(KVPoll.Success):
                if self.request.refusal:  # a chunk the daemon refused: the rest cannot
                    self._fail(f"kvbeam send of {self.request_id} failed: the daemon "
                               f"refused a chunk: {self.request.refusal}")
                    return int(KVPoll.Failed)
                if now > self.deadline:
                    self._fail(f"room {self.room}: kvbeam's transfer did not end within "
                               f"{self.mgr.waiting_timeout:g} s of decode's reservation "
                               "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
                    return int(KVPoll.Failed)
                if now >= self.next_room_check:
                    self.next_room_check = now + ROOM_CHECK_S
                    if self._decode_gave_up():
                        return int(KVPoll.Failed)
            return prefill_poll(state)
        if self.decode_posted:
            if now > self.deadline:
                self._fail(f"room {self.room}: sglang sent nothing within "
                           f"{self.mgr.waiting_timeout:g} s of decode's reservation "
                           "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
                return int(KVPoll.Failed)
            return int(KVPoll.WaitingForInput)
        detached = self.mgr.detached_reason()
        if detached:
            self._fail(f"room {self.room}: prefill's kvbeam daemon cannot take requests: "
                       f"{detached}")
            return int(KVPoll.Failed)
        try:
            decode = self.mgr.read(self.bootstrap_addr, _room_key(self.room))
        except KvbeamError as exc:
            self._fail(f"room {self.room}: {exc}")
            return int(KVPoll.Failed)
        if decode is None:
            if now > self.deadline:
                self._fail(f"room {self.room}: decode posted no destination within "
                           f"{self.mgr.bootstrap_timeout:g} s "
                           "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT); is the decode server "
                           "up, and does it reach this bootstrap server?")
                return int(KVPoll.Failed)
            return int(KVPoll.Bootstrapping)
        if decode.get("aborted"):
            self.withdrawn = True  # decode's tombstone says why: keep it
            self.error = _gave_up("decode", self.room, decode)
            log.error("%s", self.error)
            return int(KVPoll.Failed)
        self.decode_posted = True
        self.deadline = now + self.mgr.waiting_timeout
        return int(KVPoll.WaitingForInput)

    def _decode_gave_up(self) -> bool:
        """While the transfer moves: True (and aborted here) when decode left a tombstone."""
        try:
            room = self.mgr.read(self.bootstrap_addr, _room_key(self.room))
        except KvbeamError as exc:
            self._fail(f"room {self.room}: {exc}")
            return True
        if room is None or not room.get("aborted"):
            return False
        assert self.request is not None
        self.withdrawn = True
        self.error = _gave_up("decode", self.room, room)
        self.request.abort(self.error)
        log.error("%s", self.error)
        return True

    def failure_exception(self) -> None:
        """Raise the failure's description."""
        if self.error is None and self.request is not None and self.poll() == KVPoll.Failed:
            self.last = self.request.failure()
        _raise_failure(self.request_id, self.error, self.last)

    def get_transfer_metric(self) -> Any:
        """Bytes the request moves (its lists' items), once sent."""
        return KVTransferMetric(transfer_total_bytes=self.nbytes)

    def abort(self) -> None:
        """Abort at the prefill daemon (it tells decode's), and leave why in the room."""
        self._fail(f"room {self.room}: aborted by sglang on prefill")

    def clear(self) -> None:
        """Forget the room when the request moved; otherwise leave why it ended there
        (a tombstone the store forgets after the deadlines)."""
        if self.request is not None and self.request.poll() is KVPoll.Success:
            self.mgr.forget(self.bootstrap_addr, self.room)
        elif not self.withdrawn:
            self._fail(f"room {self.room}: prefill dropped the request before it ended")
        self._unstage()


class KvbeamKVReceiver(ReceiverMembers, BaseKVReceiver):  # type: ignore[misc]
    """Decode's side of one request (``bootstrap_room``), over the engine channel.

    Ends however the request goes: prefill's pools unlike ours (at ``init``, before
    anything is reserved), this side's daemon gone (Failed at the reservation), prefill's
    tombstone in the room (read at most once per :data:`ROOM_CHECK_S` while the
    reservation waits), or sglang's deadlines: ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``
    from its creation until it reserved, ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` from
    then until it ends. Whatever ends it leaves its cause in the room for prefill.
    """

    def __init__(self, mgr: KvbeamKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, bootstrap_room
        self.request_id = f"sglang-{bootstrap_room}"
        self.prefill: dict[str, Any] | None = None
        self.request: Receiver | None = None  # once reserved: the channel's record of it
        self.next_room_check = 0.0
        self.error: str | None = None
        self.gave_up = False  # the room holds why this request ended (ours or prefill's)
        self.last: Any = None  # the failure as last seen (reason, detail), for messages
        self.deadline = time.monotonic() + mgr.bootstrap_timeout
        #: Staged: the request's way through the staging buffer, and its length.
        self.staged: StagedRequest | None = None
        self.seq_len = 0
        self._init_scheduler_members()

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Look prefill's daemon up at its bootstrap server, and refuse pools that
        cannot pair with ours (each difference named with its sglang setting); fail at
        once while this side's daemon cannot take requests."""
        detached = self.mgr.detached_reason()
        if detached:
            self._fail(f"room {self.room}: decode's kvbeam daemon cannot take requests: "
                       f"{detached}")
            return
        try:
            self.prefill = self.mgr.store(self.bootstrap_addr, "get", PREFILL_KEY)
        except (OSError, RuntimeError, KvbeamError) as exc:
            self._fail(f"room {self.room}: prefill's bootstrap server {self.bootstrap_addr} "
                       f"did not answer: {exc}")
            return
        if self.prefill is None:
            self._fail(f"no kvbeam prefill registered at {self.bootstrap_addr}")
            return
        why = self.mgr.peer_mismatch(self.prefill, self.bootstrap_addr)
        if why:
            self._fail(why)

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None,
                      state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None, destination: Any = None) -> None:
        """Reserve at decode's own daemon over the engine channel (it offers the
        reservation to prefill's daemon), then post decode's daemon and the request's
        length in the room for prefill."""
        if self.prefill is None or self.error is not None:
            return  # init failed: poll says Failed
        try:
            lists = {"KV_PAGES": kv_indices,
                     **state_index_lists(self.mgr.layout, state_indices),
                     **aux_lists(self.mgr.layout, aux_index)}
            self.seq_len = decode_seq_len(self.mgr.config.target, lists)
            if self.mgr.staging is not None:
                # Staged: staging items first (now, or at a later poll), then reserve them.
                self.staged = StagedRequest(self.mgr.staging, staged.device_lists(lists))
                self._advance_staging()
                return
        except (KvbeamError, ValueError) as exc:
            self._fail(f"kvbeam reservation of {self.request_id} failed: {exc}")
            return
        self._reserve(lists)

    def _advance_staging(self) -> None:
        """Staged, before the reservation: once staging room came, reserve its items."""
        assert self.staged is not None
        items = self.staged.reserve()
        if items is not None:
            self._reserve(items.named_lists())

    def _reserve(self, lists: Mapping[str, Any]) -> None:
        """Reserve at decode's daemon (the engine's lists, or staged its staging items'),
        then post decode's daemon and the request's length in the room for prefill."""
        assert self.prefill is not None
        seq_len = self.seq_len
        try:
            request = Receiver(self.mgr.attachment, self.request_id, self.prefill["daemon"])
            request.reserve(lists["KV_PAGES"],
                            {k: v for k, v in lists.items() if k != "KV_PAGES"},
                            seq_len=seq_len)
        except (KvbeamError, ValueError) as exc:
            self._fail(f"kvbeam reservation of {self.request_id} failed: {exc}")
            return
        self.request = request
        if request.poll() is KVPoll.Failed:  # refused at once (the daemon is gone)
            self.last = request.failure()
            self._give_up(_failure_text(self.request_id, self.last))
            return
        # Posted only into an empty room: prefill may have given the request up already,
        # and its cause must not be overwritten (it would then wait out a deadline).
        try:
            present = self.mgr.store(self.bootstrap_addr, "add", _room_key(self.room),
                                     {"daemon": self.mgr.daemon, "seq_len": seq_len})
        except (OSError, RuntimeError, KvbeamError) as exc:
            request.abort(f"room {self.room} not posted")
            self._fail(f"room {self.room}: prefill's bootstrap server {self.bootstrap_addr} "
                       f"did not take decode's entry: {exc}")
            return
        if present is not None:
            request.abort(f"room {self.room} was taken")
            self.gave_up = bool(present.get("aborted"))  # prefill's cause: keep it
            self._fail(_gave_up("prefill", self.room, present) if self.gave_up else
                       f"room {self.room} already holds another entry: {present}")
            return
        now = time.monotonic()
        self.next_room_check = now + ROOM_CHECK_S
        self.deadline = now + self.mgr.waiting_timeout

    def _fail(self, error: str) -> None:
        """End the request here: remember why and tell prefill through the room (once)."""
        if self.error is None:
            self.error = error
            log.error("%s", error)
        self.conclude_state = int(KVPoll.Failed)
        self._unstage()
        self._give_up(error)

    def _unstage(self) -> None:
        """The request ended: its staging items back (staged; idempotent)."""
        if self.staged is not None:
            self.staged.release()

    def _scattered(self) -> bool:
        """Staged, after Success: the landed staging items into sglang's pool and
        metadata rows (issued once; on CUDA on a side stream); True once complete."""
        assert self.staged is not None and self.mgr.device_kv is not None
        if not self.staged.scattering:
            self._before_scatter()
        return self.staged.scatter(self.mgr.device_kv)

    def _before_scatter(self) -> None:
        """Staged: the request's bytes are in its staging items, not yet in sglang's
        pool (a test harness's negative control corrupts them here)."""

    def _give_up(self, reason: str) -> None:
        if not self.gave_up:
            self.gave_up = True
            self.mgr.give_up(self.bootstrap_addr, self.room, reason)

    def poll(self) -> int:
        """Bootstrapping before init, WaitingForInput until prefill writes, then the state
        the daemon pushed (an attribute read: no RPC).

        While the pushed state reads Bootstrapping (attached with ``pushes="final"``: until
        the request ends), at most one bootstrap-store read per :data:`ROOM_CHECK_S`
        notices a prefill that gave the request up (its tombstone says why): the
        reservation is then aborted, its pages freed.
        """
        if self.error is not None:
            return int(KVPoll.Failed)
        if self.prefill is None:
            return int(KVPoll.Bootstrapping)
        self.mgr.log_staging()
        now = time.monotonic()
        if self.request is None and self.staged is not None:
            try:
                self._advance_staging()  # staging room now? then reserve
            except (KvbeamError, ValueError) as exc:
                self._fail(f"kvbeam reservation of {self.request_id} failed: {exc}")
            if self.error is not None:
                return int(KVPoll.Failed)
        if self.request is None:
            if now > self.deadline:
                self._fail(f"room {self.room}: decode reserved nothing within "
                           f"{self.mgr.bootstrap_timeout:g} s "
                           "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
                return int(KVPoll.Failed)
            return int(KVPoll.WaitingForInput)
        state = int(self.request.poll())
        if state == int(KVPoll.Bootstrapping):
            if now > self.deadline:
                self.request.abort("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
                self._fail(f"room {self.room}: prefill wrote nothing within "
                           f"{self.mgr.waiting_timeout:g} s of the reservation "
                           "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
                return int(KVPoll.Failed)
            if now >= self.next_room_check:
                self.next_room_check = now + ROOM_CHECK_S
                try:
                    room = self.mgr.read(self.bootstrap_addr, _room_key(self.room))
                except KvbeamError as exc:
                    self.request.abort(str(exc))
                    self._fail(f"room {self.room}: {exc}")
                    return int(KVPoll.Failed)
                if room is not None and room.get("aborted"):
                    self.gave_up = True  # prefill's tombstone says why: keep it
                    self.request.abort(f"prefill gave room {self.room} up")
                    self._fail(_gave_up("prefill", self.room, room))
                    return int(KVPoll.Failed)
        if state == int(KVPoll.Failed):
            self.last = self.request.failure()
            self.conclude_state = state
            self._unstage()
            self._give_up(_failure_text(self.request_id, self.last))
        elif state == int(KVPoll.Success) and self.staged is not None:
            try:  # sglang reads the pool and the metadata row once we say Success
                if not self._scattered():
                    return int(KVPoll.Transferring)
            except KvbeamError as exc:
                self._fail(f"kvbeam: room {self.room}: the scatter of the staged request "
                           f"failed: {exc}")
                return int(KVPoll.Failed)
        return decode_poll(state)

    def failure_exception(self) -> None:
        """Raise the failure's description."""
        if self.error is None and self.request is not None:
            self.last = self.request.failure()
        _raise_failure(self.request_id, self.error, self.last)

    def abort(self) -> None:
        """Abort at the decode daemon (it tells prefill's) and leave why in the room."""
        if self.request is not None:  # never reserved: nothing held
            self.request.abort("aborted by sglang")
        self._fail(f"room {self.room}: aborted by sglang on decode")

    def clear(self) -> None:
        """Release the reservation (the engine took the KV over) and forget the room; a
        request that did not move is aborted at the daemon and its cause left in the
        room (a tombstone the store forgets after the deadlines)."""
        if self.request is not None and self.request.poll() is KVPoll.Success:
            self.request.release()
            self._unstage()
            self.mgr.forget(self.bootstrap_addr, self.room)
            return
        if self.request is not None and self.request.poll() is not KVPoll.Failed:
            self.request.abort("cleared by sglang before it ended")
        if not self.gave_up:
            self._fail(f"room {self.room}: decode dropped the request before it ended")
        self._unstage()


class KvbeamKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc]
    """The prefill server's rendezvous (:class:`~kvbeam.integrations.sglang.bootstrap.
    BootstrapServer`) on sglang's ``--disaggregation-bootstrap-port``."""

    def __init__(self, host: str, port: int) -> None:
        self.server = bootstrap.BootstrapServer(host, port, token=credentials(None).token,
                                                insecure=insecure_from_environment(
                                                    os.environ, "kvbeam sglang backend"))

    def close(self) -> None:
        """Stop the server."""
        self.server.close()


def _failure_text(request_id: str, failed: tuple[FailureReason | None, str] | None) -> str:
    """A daemon's failure of the request as one sentence."""
    if failed is None:
        return f"kvbeam request {request_id} failed"
    reason = failed[0].value if failed[0] else "unknown"
    return f"kvbeam request {request_id} failed: {reason}: {failed[1]}"


def _gave_up(side: str, room: Any, entry: Mapping[str, Any] | None) -> str:
    """The other side's tombstone (or its room gone) as this side's failure."""
    if not entry:
        return f"{side}'s room {room} is gone: {side} ended the request without a cause"
    return f"{side} gave room {room} up: {entry.get('reason') or 'no cause given'}"


def _raise_failure(request_id: str, error: str | None,
                   failed: tuple[FailureReason | None, str] | None) -> None:
    if error is not None:
        raise RuntimeError(error)
    if failed is not None:
        raise RuntimeError(_failure_text(request_id, failed))


def moved_bytes(layout: SideLayout, lists: Mapping[str, Any]) -> int:
    """The bytes a request with these lists moves: every buffer's items of its list (a
    draft buffer's own ``draft.KIND`` list when given, else the target's)."""
    total = 0
    for comp in layout.components:
        for buf in comp.buffers:
            kind = buf.index_kind.name
            own = lists.get(f"draft.{kind}") if comp.pool == "draft" else None
            total += len(own if own is not None else lists.get(kind, ())) * buf.item_len
    return total

