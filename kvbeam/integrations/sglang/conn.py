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

Settings (attributes of sglang's ``server_args`` when present, else environment):
``kvbeam_config`` / ``KVBEAM_CONFIG`` (the side YAML the daemon runs with),
``kvbeam_daemon`` / ``KVBEAM_DAEMON`` (its gRPC address, which the peer daemon is
told), ``kvbeam_attach_socket`` / ``KVBEAM_ATTACH_SOCKET``; credentials, the daemons'
flags of the same names (:data:`kvbeam.auth.CLIENT_SETTINGS`): ``kvbeam_auth_token_file``
/ ``KVBEAM_AUTH_TOKEN_FILE``, ``kvbeam_tls_cert`` / ``KVBEAM_TLS_CERT``, ``..._tls_key``,
``..._tls_ca``, ``..._tls_server_name``. Every bootstrap store request carries the
token, and the store requires it (sglang builds the store from host and port only, so
there the environment's ``KVBEAM_AUTH_TOKEN_FILE`` counts); :meth:`KvbeamKVManager.client`
(diagnostics, not the request path) presents them all.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvbeam.auth import CLIENT_SETTINGS, Security, client_security, insecure_from_environment
from kvbeam.engine import Attachment, Receiver, Sender, attach
from kvbeam.engine.requests import KVPoll, client_for
from kvbeam.errors import AttachError, KvbeamError, PoolCompatibilityError
from kvbeam.integrations.sglang import bootstrap
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
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.states import FailureReason

if TYPE_CHECKING:  # annotations only: kvbeam.client imports gRPC
    from kvbeam.client import KvbeamClient

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


def _setting(server_args: Any, name: str) -> str:
    value = getattr(server_args, name, None) or os.environ.get(name.upper())
    if not value:
        raise RuntimeError(f"kvbeam sglang backend: set server_args.{name} or {name.upper()}")
    return str(value)


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


class KvbeamKVManager(ManagerMembers, BaseKVManager):  # type: ignore[misc]
    """One per server: checks the pools ``KVArgs`` describes and attaches them.

    Raises (at construction, before anything is attached):
        RuntimeError: sglang's DSV4 target/draft checks failed, with sglang's wording
            ("DSV4 target and draft pools must use the same unified-KV mode: ...").
        AttachError: ``KVArgs`` does not match the kvbeam config, is not in shareable
            memory, or the daemon refused the attach.
    """

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.mode = str(getattr(disaggregation_mode, "value", disaggregation_mode))
        self.server_args = server_args
        path = _setting(server_args, "kvbeam_config")
        self.config = SideConfig.from_mapping(yaml.safe_load(Path(path).read_text()), path)
        self.layout = build_side_layout(self.config)
        try:
            check_target_draft(self.layout, self.mode)
        except PoolCompatibilityError as exc:
            raise RuntimeError(str(exc)) from exc
        check_kvargs(args, self.layout)
        self.security = credentials(server_args)
        self.daemon = _setting(server_args, "kvbeam_daemon")
        self._init_scheduler_members()
        self.attachment = self._attach(_setting(server_args, "kvbeam_attach_socket"))
        if self.mode == "prefill" and getattr(server_args, "disaggregation_bootstrap_port",
                                              None) is not None:
            self.register_to_bootstrap()  # sglang's schedulers never call it for kvbeam

    def _attach(self, sock: str, timeout: float = 180.0) -> Attachment:
        buffers = buffers_from_kvargs(self.kv_args, self.layout)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    # Only a request's end is pushed: sglang's queues read every
                    # other daemon state as in progress (prefill_poll, decode_poll),
                    # and each push would wake the reader thread in sglang's scheduler.
                    # A restarted daemon gets the same memory again (reattach keeps
                    # duplicates of the fds closed below); meanwhile polls read Failed.
                    return attach(sock, buffers, self.config, pushes="final",
                                  reattach=True)
                except AttachError as exc:
                    # The daemon beside the server may still be starting (importing torch
                    # takes a minute under emulation): retry then only.
                    if not str(exc).startswith("cannot attach") or time.monotonic() > deadline:
                        raise
                time.sleep(0.1)
        finally:
            for fd in buffers.fds:
                os.close(fd)

    def client(self, address: str) -> KvbeamClient:
        """The shared client to the daemon at ``address``, presenting our credentials
        (diagnostics and tools: no per-request call uses gRPC; imported on first use)."""
        return client_for(address, self.security)

    def store(self, address: str, op: str, key: str, value: Any = None,
              timeout: float = 10.0) -> Any:
        """One operation on the bootstrap store at ``address``, with our token."""
        return bootstrap.call(address, op, key, value, timeout, token=self.security.token)

    def close(self) -> None:
        """Detach the engine's memory (the daemon fails its live requests)."""
        self.attachment.close()


class KvbeamKVSender(BaseKVSender):  # type: ignore[misc]
    """Prefill's side of one request (``bootstrap_room``), over the engine channel."""

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
        self.withdrawn = False
        self.error: str | None = None
        self.nbytes: int | None = None
        self.last: Any = None  # the failure as last seen (reason, detail), for messages

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Remember how many pages the request has (the last chunk completes them) and
        its metadata row (``aux_index``)."""
        self.num_pages = num_kv_indices
        self.aux_index = aux_index

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None, **_: Any) -> None:
        """One chunk's pages, sent at once: a SEND frame that gives the daemon this
        chunk's token range and the KV pages it adds (``Sender.send_chunk``), so its
        bytes move while sglang computes the next chunk. The last chunk (states given, or
        all pages) also carries the states and the metadata row; decode is Success once
        it landed and was verified.
        """
        if num_kv_tokens is None:
            raise ValueError("kvbeam needs num_kv_tokens on every send (sglang >= 0.5.23)")
        if self.error is not None:
            return  # failed (or aborted) already: poll says Failed
        pages = [int(p) for p in kv_indices]
        start = self.tokens
        self.pages.extend(pages)
        self.tokens += num_kv_tokens
        final = state_indices is not None or len(self.pages) >= self.num_pages
        try:
            self._send_chunk(pages, start, final, state_indices)
        except (KvbeamError, RuntimeError, OSError, ValueError) as exc:
            self.error = f"kvbeam send of {self.request_id} failed: {exc}"
            log.error("%s", self.error)
            if self.request is not None:  # earlier chunks may be moving: stop them
                self.request.abort(self.error)
            self._withdraw()

    def _send_chunk(self, pages: list[int], start: int, final: bool,
                    state_indices: list[Any] | None) -> None:
        if self.request is None:
            self._start()
        assert self.request is not None and self.seq_len is not None
        seq_len, states = self.seq_len, None
        if final:
            if not same_lists(self.mgr.config.target, self.mgr.layout, self.tokens, seq_len):
                raise RuntimeError(f"room {self.room}: prefill computed {self.tokens} tokens, "
                                   f"decode reserved {seq_len}: their index lists differ")
            states = {**state_index_lists(self.mgr.layout, state_indices),
                      **aux_lists(self.mgr.layout, self.aux_index)}
            self.nbytes = moved_bytes(self.mgr.layout, {"KV_PAGES": self.pages, **states})
        # Decode's length is authoritative (it reserved with it; the lists are the same):
        # the last chunk runs to its end, the others end where sglang's did (page-aligned).
        self.request.send_chunk(pages, (start, seq_len if final else self.tokens),
                                seq_len=seq_len, final=final, state_indices=states)

    def _start(self) -> None:
        """At the first chunk: decode's daemon and length from the room (read again, not
        the cached sighting: decode may have aborted since), checked against ours."""
        decode = self.mgr.store(self.bootstrap_addr, "get", _room_key(self.room))
        if not decode or decode.get("aborted"):
            raise RuntimeError(f"decode gave no destination for room {self.room}")
        seq_len = decode.get("seq_len")
        if not isinstance(seq_len, int) or not isinstance(decode.get("daemon"), str):
            raise RuntimeError(f"room {self.room}: decode's entry names no daemon and "
                               f"seq_len (a kvbeam older than the engine channel?): {decode}")
        want = expected_lengths(self.mgr.config.target, seq_len)[IndexKind.KV_PAGES]
        if self.num_pages != want:
            raise RuntimeError(f"room {self.room}: prefill has {self.num_pages} KV pages, "
                               f"decode reserved {want} ({seq_len} tokens): their index "
                               "lists differ")
        self.seq_len = seq_len
        self.request = Sender(self.mgr.attachment, self.request_id, decode["daemon"])

    def _withdraw(self) -> None:
        """Tell decode through the room that this request will not come (once): its poll
        aborts its reservation."""
        if self.withdrawn:
            return
        self.withdrawn = True
        try:
            self.mgr.store(self.bootstrap_addr, "put", _room_key(self.room), {"aborted": True})
        except (OSError, RuntimeError) as exc:
            log.warning("kvbeam: room %s: could not tell decode of the failure: %s", self.room,
                        exc)

    def poll(self) -> int:
        """Bootstrapping until decode sent its metadata, WaitingForInput, then the state
        the daemon pushed (an attribute read: no RPC, no syscall). Its handshake reads
        Transferring: sglang's inflight queue takes no Bootstrapping."""
        if self.error is not None:
            return int(KVPoll.Failed)
        if self.request is not None:
            state = int(self.request.poll())
            if state == int(KVPoll.Failed):
                self.last = self.request.failure()
                self._withdraw()  # refused before decode heard of it: decode frees its pages
            return prefill_poll(state)
        if self.decode_posted:
            return int(KVPoll.WaitingForInput)
        decode = self.mgr.store(self.bootstrap_addr, "get", _room_key(self.room))
        if decode is None:
            return int(KVPoll.Bootstrapping)
        if decode.get("aborted"):
            return int(KVPoll.Failed)
        self.decode_posted = True
        return int(KVPoll.WaitingForInput)

    def failure_exception(self) -> None:
        """Raise the failure's description."""
        if self.error is None and self.request is not None and self.poll() == KVPoll.Failed:
            self.last = self.request.failure()
        _raise_failure(self.request_id, self.error or (
            "aborted" if self.withdrawn and self.last is None else None), self.last)

    def get_transfer_metric(self) -> Any:
        """Bytes the request moves (its lists' items), once sent."""
        return KVTransferMetric(transfer_total_bytes=self.nbytes)

    def abort(self) -> None:
        """Abort at the prefill daemon (it tells decode's), and withdraw the room."""
        if self.request is not None:
            self.request.abort("aborted by sglang")
        self._withdraw()
        self.error = self.error or "aborted"

    def clear(self) -> None:
        """Forget the room at the bootstrap server."""
        self.mgr.store(self.bootstrap_addr, "delete", _room_key(self.room))


class KvbeamKVReceiver(ReceiverMembers, BaseKVReceiver):  # type: ignore[misc]
    """Decode's side of one request (``bootstrap_room``), over the engine channel."""

    def __init__(self, mgr: KvbeamKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, bootstrap_room
        self.request_id = f"sglang-{bootstrap_room}"
        self.prefill: dict[str, Any] | None = None
        self.request: Receiver | None = None  # once reserved: the channel's record of it
        self.metadata_sent = False
        self.next_room_check = 0.0
        self.error: str | None = None
        self.last: Any = None  # the failure as last seen (reason, detail), for messages
        self._init_scheduler_members()

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Look prefill's daemon up at its bootstrap server."""
        self.prefill = self.mgr.store(self.bootstrap_addr, "get", PREFILL_KEY)
        if self.prefill is None:
            self.error = f"no kvbeam prefill registered at {self.bootstrap_addr}"
            self.conclude_state = int(KVPoll.Failed)

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None,
                      state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None, destination: Any = None) -> None:
        """Reserve at decode's own daemon over the engine channel (it offers the
        reservation to prefill's daemon), then post decode's daemon and the request's
        length in the room for prefill."""
        if self.prefill is None:
            return  # init failed: poll says Failed
        try:
            lists = {"KV_PAGES": kv_indices,
                     **state_index_lists(self.mgr.layout, state_indices),
                     **aux_lists(self.mgr.layout, aux_index)}
            seq_len = decode_seq_len(self.mgr.config.target, lists)
            request = Receiver(self.mgr.attachment, self.request_id, self.prefill["daemon"])
            request.reserve(lists["KV_PAGES"],
                            {k: v for k, v in lists.items() if k != "KV_PAGES"},
                            seq_len=seq_len)
        except (KvbeamError, ValueError) as exc:
            self.error = f"kvbeam reservation of {self.request_id} failed: {exc}"
            log.error("%s", self.error)
            self.mgr.store(self.bootstrap_addr, "put", _room_key(self.room), {"aborted": True})
            return
        self.request = request
        self.mgr.store(self.bootstrap_addr, "put", _room_key(self.room),
                       {"daemon": self.mgr.daemon, "seq_len": seq_len})
        self.metadata_sent = True
        self.next_room_check = time.monotonic() + ROOM_CHECK_S

    def poll(self) -> int:
        """Bootstrapping before init, WaitingForInput until prefill writes, then the state
        the daemon pushed (an attribute read: no RPC).

        While the pushed state reads Bootstrapping (attached with ``pushes="final"``: until
        the request ends), at most one bootstrap-store read per :data:`ROOM_CHECK_S`
        notices a prefill that gave the request up before sending (its daemon never heard
        of it): the reservation is then aborted, its pages freed.
        """
        if self.error is not None:
            return int(KVPoll.Failed)
        if self.prefill is None:
            return int(KVPoll.Bootstrapping)
        if self.request is None:
            return int(KVPoll.WaitingForInput)
        state = int(self.request.poll())
        if state == int(KVPoll.Bootstrapping) and time.monotonic() >= self.next_room_check:
            self.next_room_check = time.monotonic() + ROOM_CHECK_S
            room = self.mgr.store(self.bootstrap_addr, "get", _room_key(self.room))
            if room is not None and room.get("aborted"):
                self.request.abort(f"prefill gave room {self.room} up before sending")
                self.error = f"prefill aborted room {self.room} before sending"
                return int(KVPoll.Failed)
        if state == int(KVPoll.Failed):
            self.last = self.request.failure()
        return decode_poll(state)

    def failure_exception(self) -> None:
        """Raise the failure's description."""
        if self.error is None and self.request is not None:
            self.last = self.request.failure()
        _raise_failure(self.request_id, self.error, self.last)

    def abort(self) -> None:
        """Abort at the decode daemon (it tells prefill's) and withdraw the room."""
        self.mgr.store(self.bootstrap_addr, "put", _room_key(self.room), {"aborted": True})
        if self.request is not None:  # never reserved: nothing held
            self.request.abort("aborted by sglang")
        self.error = self.error or "aborted"

    def clear(self) -> None:
        """Release the reservation (the engine took the KV over) and forget the room."""
        if self.request is not None and self.request.poll() is KVPoll.Success:
            self.request.release()
        self.mgr.store(self.bootstrap_addr, "delete", _room_key(self.room))


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


def _raise_failure(request_id: str, error: str | None,
                   failed: tuple[FailureReason | None, str] | None) -> None:
    if error is not None:
        raise RuntimeError(error)
    if failed is not None:
        reason = failed[0].value if failed[0] else "unknown"
        raise RuntimeError(f"kvbeam request {request_id} failed: {reason}: {failed[1]}")


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

