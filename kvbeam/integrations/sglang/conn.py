"""kvbeam as an sglang transfer backend: manager, sender, receiver, bootstrap server.

Subclasses of sglang's own base classes (``sglang.srt.disaggregation.base.conn``,
sglang 0.5.23) on :mod:`kvbeam.engine`. Each server process runs a kvbeam daemon
beside it (``kvbeam prefill|decode --pools engine --attach-socket PATH``); the
manager attaches the engine's pools that ``KVArgs`` points at, the daemons move the
bytes. docs/sglang.md.

Settings (attributes of sglang's ``server_args`` when present, else environment):
``kvbeam_config`` / ``KVBEAM_CONFIG`` (the side YAML the daemon runs with),
``kvbeam_daemon`` / ``KVBEAM_DAEMON`` (its gRPC address), ``kvbeam_attach_socket`` /
``KVBEAM_ATTACH_SOCKET``; credentials, the daemons' flags of the same names
(:data:`kvbeam.auth.CLIENT_SETTINGS`): ``kvbeam_auth_token_file`` /
``KVBEAM_AUTH_TOKEN_FILE``, ``kvbeam_tls_cert`` / ``KVBEAM_TLS_CERT``, ``..._tls_key``,
``..._tls_ca``, ``..._tls_server_name``. Every daemon call presents them, and every
bootstrap store request the token; the store requires it (sglang builds the store from
host and port only, so there the environment's ``KVBEAM_AUTH_TOKEN_FILE`` counts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import yaml

from kvbeam.auth import CLIENT_SETTINGS, Security, client_security, insecure_from_environment
from kvbeam.client import KvbeamClient
from kvbeam.engine import Attachment, attach
from kvbeam.engine.requests import KVPoll, client_for, poll_of
from kvbeam.errors import AttachError, KvbeamError, PoolCompatibilityError, UnknownRequest
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
    prefill_poll,
)
from kvbeam.pools.checks import check_target_draft
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import SideConfig
from kvbeam.states import TransferState

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
                    return attach(sock, buffers, self.config)
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
        """The shared client to the daemon at ``address``, presenting our credentials."""
        return client_for(address, self.security)

    def store(self, address: str, op: str, key: str, value: Any = None,
              timeout: float = 10.0) -> Any:
        """One operation on the bootstrap store at ``address``, with our token."""
        return bootstrap.call(address, op, key, value, timeout, token=self.security.token)

    def close(self) -> None:
        """Detach the engine's memory (the daemon fails its live requests)."""
        self.attachment.close()


class KvbeamKVSender(BaseKVSender):  # type: ignore[misc]
    """Prefill's side of one request (``bootstrap_room``)."""

    def __init__(self, mgr: KvbeamKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, bootstrap_room
        self.request_id = f"sglang-{bootstrap_room}"
        self.num_pages = 0
        self.aux_index: int | None = None
        self.pages: list[Any] = []
        self.tokens = 0
        self.sent = False
        self.error: str | None = None
        self.last: Any = None

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Remember how many pages the request has (the last chunk completes them) and
        its metadata row (``aux_index``)."""
        self.num_pages = num_kv_indices
        self.aux_index = aux_index

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None, **_: Any) -> None:
        """One chunk's pages; the last (states given, or all pages) moves the request.

        sglang's sender learns the request's length only as chunks arrive
        (``num_kv_tokens``), and kvbeam needs it for the whole request, so earlier
        chunks are collected and the request moves as one kvbeam send at the last.
        """
        if num_kv_tokens is None:
            raise ValueError("kvbeam needs num_kv_tokens on every send (sglang >= 0.5.23)")
        self.pages.extend(int(p) for p in kv_indices)
        self.tokens += num_kv_tokens
        if state_indices is None and len(self.pages) < self.num_pages:
            return
        try:
            self._send_all(state_indices)
        except (KvbeamError, RuntimeError, OSError, ValueError) as exc:
            self.error = f"kvbeam send of {self.request_id} failed: {exc}"
            log.error("%s", self.error)

    def _send_all(self, state_indices: list[Any] | None) -> None:
        decode = self.mgr.store(self.bootstrap_addr, "get", _room_key(self.room))
        if not decode or decode.get("aborted"):
            raise RuntimeError(f"decode gave no destination for room {self.room}")
        lists = {"KV_PAGES": self.pages, **state_index_lists(self.mgr.layout, state_indices),
                 **aux_lists(self.mgr.layout, self.aux_index)}
        # Decode's reservation: its own lists, the length only prefill knows by now.
        decode_client = self.mgr.client(decode["daemon"])
        decode_client.reserve(self.request_id, self.tokens, self.mgr.daemon,
                              indices=decode["lists"])
        try:
            self.last = self.mgr.client(self.mgr.daemon).send(
                self.request_id, -1, self.tokens, decode["daemon"], indices=lists)
        except KvbeamError as exc:
            # Refused before anything moved: give decode's slot back.
            decode_client.abort(self.request_id, f"prefill's send was refused: {exc}")
            raise
        self.sent = True

    def poll(self) -> int:
        """Bootstrapping until decode sent its metadata, WaitingForInput, then kvbeam's
        (its handshake reads Transferring: sglang's inflight queue takes no Bootstrapping)."""
        if self.error is not None:
            return int(KVPoll.Failed)
        if self.sent:
            self.last = self.mgr.client(self.mgr.daemon).status(self.request_id)
            return prefill_poll(int(poll_of(self.last.state)))
        decode = self.mgr.store(self.bootstrap_addr, "get", _room_key(self.room))
        if decode is None:
            return int(KVPoll.Bootstrapping)
        return int(KVPoll.Failed if decode.get("aborted") else KVPoll.WaitingForInput)

    def failure_exception(self) -> None:
        """Raise the failure's description."""
        _raise_failure(self.request_id, self.error, self.last)

    def get_transfer_metric(self) -> Any:
        """Bytes moved, as the prefill daemon counted them."""
        return KVTransferMetric(transfer_total_bytes=getattr(self.last, "bytes_done", None))

    def abort(self) -> None:
        """Abort at the prefill daemon (it tells decode's), or tell decode through the room."""
        if self.sent:
            self.last = self.mgr.client(self.mgr.daemon).abort(self.request_id, "aborted by sglang")
        else:
            self.mgr.store(self.bootstrap_addr, "put", _room_key(self.room), {"aborted": True})
        self.error = self.error or "aborted"

    def clear(self) -> None:
        """Forget the room at the bootstrap server."""
        self.mgr.store(self.bootstrap_addr, "delete", _room_key(self.room))


class KvbeamKVReceiver(ReceiverMembers, BaseKVReceiver):  # type: ignore[misc]
    """Decode's side of one request (``bootstrap_room``)."""

    def __init__(self, mgr: KvbeamKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, bootstrap_room
        self.request_id = f"sglang-{bootstrap_room}"
        self.prefill: dict[str, Any] | None = None
        self.metadata_sent = False
        self.error: str | None = None
        self.last: Any = None
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
        """Publish the destination lists for prefill, which reserves with them."""
        lists = {"KV_PAGES": kv_indices,
                 **state_index_lists(self.mgr.layout, state_indices),
                 **aux_lists(self.mgr.layout, aux_index)}
        value = {"daemon": self.mgr.daemon,
                 "lists": {k: [int(i) for i in v] for k, v in lists.items()}}
        self.mgr.store(self.bootstrap_addr, "put", _room_key(self.room), value)
        self.metadata_sent = True

    def poll(self) -> int:
        """Bootstrapping before init, WaitingForInput until reserved, then kvbeam's."""
        if self.error is not None:
            return int(KVPoll.Failed)
        if self.prefill is None:
            return int(KVPoll.Bootstrapping)
        if not self.metadata_sent:
            return int(KVPoll.WaitingForInput)
        daemon = self.mgr.client(self.mgr.daemon)
        try:
            self.last = daemon.status(self.request_id)
        except UnknownRequest:  # prefill has not reserved yet, or gave up
            room = self.mgr.store(self.bootstrap_addr, "get", _room_key(self.room))
            if room is not None and not room.get("aborted"):
                return int(KVPoll.WaitingForInput)
            # Prefill deletes the room when it is done: it may have reserved, moved and
            # cleared between the two calls above. Only a request decode's daemon still
            # does not know was given up before reserving.
            try:
                self.last = daemon.status(self.request_id)
            except UnknownRequest:
                self.error = f"prefill aborted room {self.room} before reserving"
                return int(KVPoll.Failed)
        return int(poll_of(self.last.state))

    def failure_exception(self) -> None:
        """Raise the failure's description."""
        _raise_failure(self.request_id, self.error, self.last)

    def abort(self) -> None:
        """Abort at the decode daemon (it tells prefill's) and withdraw the metadata."""
        self.mgr.store(self.bootstrap_addr, "put", _room_key(self.room), {"aborted": True})
        with contextlib.suppress(UnknownRequest):  # never reserved: nothing held
            self.last = self.mgr.client(self.mgr.daemon).abort(self.request_id, "aborted by sglang")
        self.error = self.error or "aborted"

    def clear(self) -> None:
        """Release the reservation (the engine took the KV over) and forget the room."""
        if self.last is not None and self.last.state is TransferState.SUCCESS:
            self.last = self.mgr.client(self.mgr.daemon).release(self.request_id)
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


def _raise_failure(request_id: str, error: str | None, last: Any) -> None:
    if error is not None:
        raise RuntimeError(error)
    if last is not None and last.state is TransferState.FAILED:
        reason = last.reason.value if last.reason else "unknown"
        raise RuntimeError(f"kvbeam request {request_id} failed: {reason}: {last.detail}")

