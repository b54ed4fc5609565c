"""The reference engines' transfer through kvbeam's daemons (``--pools engine``).

:class:`ServedPair` starts a prefill and a decode daemon as fresh processes in
``--pools engine`` mode, allocates each engine's pools in memfds
(:class:`~kvbeam.engine.EnginePools`, which the reference engine uses as its side
memory) and attaches them. :meth:`ServedPair.transfer` is a
:data:`~kvbeam.refengine.run.Transfer`: decode reserves the request at the decode
engine's own lists, prefill sends it from the prefill engine's lists, both must
reach Success (decode's only after the XXH3-128 digests matched), and decode
releases it. Each transfer's bytes and Send->Success time are recorded.

Staged (``staging=Staging(device)``): the engines' KV lives in ordinary tensors on
``device`` (``cuda`` for the reference engine on a GPU, ``cpu`` for the same path on
CPU tensors that are not the attached memory), and what each engine attaches is a
staging buffer (:class:`~kvbeam.engine.staging.StagingBuffer`): prefill gathers the
request into its buffer before the send, decode lands in its buffer and scatters into
its KV after Success, before it decodes (docs/gpu.md).

Start the pair BEFORE the model runs: the daemons are subprocesses, and a process
must not fork after torch ran parallel work.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import yaml

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient
from kvbeam.engine import EnginePools, attach
from kvbeam.engine.attach import Attachment
from kvbeam.engine.staging import StagingBuffer
from kvbeam.errors import AttachError, DaemonStartError, TransferFailed
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.plan import IndexLists
from kvbeam.pools.spec import SideConfig
from kvbeam.procs import DaemonProcess, PendingDaemon, spawn_daemon
from kvbeam.proto.attach_codec import config_to_mapping
from kvbeam.refengine.engine import Continuation
from kvbeam.refengine.memory import SideMemory
from kvbeam.refengine.model import ModelShape
from kvbeam.refengine.run import Comparison, colocated, compare, make_prompt, torch_threads
from kvbeam.scheduler import RequestResult, run_request
from kvbeam.states import TransferState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Staging:
    """How a staged pair's engines hold their KV: on ``device``, through staging buffers
    of ``requests`` requests of up to ``tokens`` tokens (default: the config's
    ``max_context_len``)."""

    device: str = "cpu"
    requests: int = 2
    tokens: int | None = None


@dataclass
class ServedPair:
    """Two ``--pools engine`` daemons with the engines' memfd pools attached.

    Args:
        config: the side config of both engines (the daemons get it as ``--config``).
        transport: ``tcp`` or ``rdma``.
        extra: more daemon flags (both daemons).
        env: more daemon environment; ``decode_env``: the decode daemon's only
            (fault hooks).
        security: the credentials the daemons require (their token travels in
            ``env`` as KVBEAM_AUTH_TOKEN); None for an open loopback pair.
        timeout: seconds a transfer may take before it counts as failed.
        staging: stage the engines' KV (on ``staging.device``) through host buffers;
            None: the engines compute in the attached memfds themselves.
    """

    config: SideConfig
    transport: str = "tcp"
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)
    security: Security | None = None
    timeout: float = 60.0
    prefix: str = "ref"
    staging: Staging | None = None
    #: one :class:`~kvbeam.scheduler.RequestResult` per transfer, in order
    records: list[RequestResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvbeam-served-")
        work = Path(self._dir.name)
        os.chmod(work, 0o700)  # the attach socket's directory must not be writable by others
        self._daemons: list[DaemonProcess] = []
        self._attachments: list[Attachment] = []
        self._pending: list[PendingDaemon] = []
        self._staging: list[StagingBuffer] = []
        #: The device the engines compute on.
        self.device = self.staging.device if self.staging is not None else "cpu"
        if self.staging is None:
            self.prefill_pools = EnginePools(self.config)
            self.decode_pools = EnginePools(self.config)
            #: What each engine computes in: the attached pools, or its device KV (staged).
            self.prefill_side: SideMemory = self.prefill_pools
            self.decode_side: SideMemory = self.decode_pools
        else:
            st = self.staging
            self._staging = [StagingBuffer(self.config, device=st.device, requests=st.requests,
                                           tokens=st.tokens) for _ in range(2)]
            self.prefill_pools, self.decode_pools = (b.pools for b in self._staging)
            layout = build_side_layout(self.config)
            self.prefill_side = AllocatedSide(layout, st.device)
            self.decode_side = AllocatedSide(layout, st.device)
        cfg = work / "side.yaml"  # what the engines attach: their pools' own config
        cfg.write_text(yaml.safe_dump(config_to_mapping(self.prefill_pools.config)))
        try:
            pending = {role: self._spawn(role, str(cfg), str(work / f"{role}.sock"))
                       for role in ("decode", "prefill")}
            self._pending = list(pending.values())
            for role, pools in (("decode", self.decode_pools), ("prefill", self.prefill_pools)):
                self._attachments.append(self._attach(pending[role], str(work / f"{role}.sock"),
                                                      pools))
            self.decode = pending["decode"].ready()
            self._daemons.append(self.decode)
            self.prefill = pending["prefill"].ready()
            self._daemons.append(self.prefill)
        except BaseException:
            self.close()
            raise
        self._clients = (KvbeamClient(self.prefill.address, security=self.security),
                         KvbeamClient(self.decode.address, security=self.security))
        log.info("served pair: prefill %s, decode %s, transport %s", self.prefill.address,
                 self.decode.address, self.prefill.transport)

    def _attach(self, daemon: PendingDaemon, sock: str, pools: EnginePools,
                timeout: float = 180.0) -> Attachment:
        """Attach once the daemon listens on ``sock`` (it starts up meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return attach(sock, pools)
            except AttachError as exc:
                # Not listening yet (no socket file, or bound but not listening): retry.
                if not str(exc).startswith("cannot attach") or daemon.proc.poll() is not None \
                        or time.monotonic() > deadline:
                    raise DaemonStartError(f"kvbeam {daemon.role} --pools engine: {exc} "
                                           f"(exit code {daemon.proc.poll()})",
                                           "".join(daemon.lines)) from exc
            time.sleep(0.1)

    def _spawn(self, role: str, config: str, sock: str) -> PendingDaemon:
        flags = ["--pools", "engine", "--attach-socket", sock, "--transport", self.transport,
                 *self.extra]
        env = {**self.env, **(self.decode_env if role == "decode" else {})}
        return spawn_daemon(role, config, extra=flags, env=env, security=self.security)

    def transfer(self, src_lists: IndexLists, dst_lists: IndexLists, seq_len: int) -> None:
        """Move one request from the prefill engine's lists to the decode engine's.

        Staged: gathered into prefill's staging buffer first (the send waits for the
        copy), landed in decode's, scattered into decode's KV only after Success.

        Raises:
            TransferFailed: either side did not reach Success within ``timeout``
                (the message carries both sides' state); the decode engine must not
                decode from the state then.
            StagingFull: a staging buffer had no room within its wait.
        """
        if not self._staging:
            self._transfer(src_lists, dst_lists, seq_len)
            return
        out, inn = self._staging
        staged = out.stage_out(self.prefill_side, src_lists)
        landing = None
        try:
            assert staged.copy is not None
            staged.copy.wait()  # the send only after the gather completed
            landing = inn.reserve(dst_lists)
            self._transfer(staged.lists, landing.lists, seq_len)
            inn.stage_in(landing, self.decode_side, dst_lists).wait()
        finally:
            out.release(staged)
            if landing is not None:
                inn.release(landing)

    @property
    def staging_buffers(self) -> tuple[StagingBuffer, ...]:
        """(prefill's, decode's) staging buffers; empty when not staged."""
        return tuple(self._staging)

    def _transfer(self, src_lists: IndexLists, dst_lists: IndexLists, seq_len: int) -> None:
        prefill, decode = self._clients
        rid = f"{self.prefix}-{len(self.records)}"
        # The engine keeps a list per kind it knows; the daemon takes the layout's kinds only.
        kinds = {b.index_kind for b in self.prefill_pools.layout.flat_buffers}
        result = run_request(prefill, decode, rid, seq_len, -1, timeout=self.timeout,
                             busy_retry_s=self.timeout,
                             src_indices={k.name: v for k, v in src_lists.items() if k in kinds},
                             dst_indices={k.name: v for k, v in dst_lists.items() if k in kinds})
        self.records.append(result)
        if not result.ok or result.prefill_state != TransferState.SUCCESS.value:
            reason = result.state.removeprefix("Failed(").partition(",")[0]
            raise TransferFailed(f"request {rid} (seq_len {seq_len}) did not complete: decode "
                                 f"{result.state}; prefill {result.prefill_state}",
                                 reason=reason, detail=result.state)

    def close(self) -> None:
        """Detach the engines, stop the daemons, free the pools."""
        for client in getattr(self, "_clients", ()):
            client.close()
        for att in self._attachments:
            att.close()
        for daemon in self._daemons:
            daemon.stop()
        for p in self._pending:  # one that never got ready
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(10)
        if self._staging:
            for buf in self._staging:
                buf.close()
        else:
            self.prefill_pools.close()
            self.decode_pools.close()
        self._dir.cleanup()

    def __enter__(self) -> ServedPair:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True)
class ServedRow:
    """One prompt through the served pair: the comparison and the transfer's record."""

    comparison: Comparison
    record: RequestResult


def run_prompts(pair: ServedPair, prompt_lens: Sequence[int], k: int) -> list[ServedRow]:
    """Each prompt colocated and prefill -> daemons -> decode; one row per prompt.

    A transfer that fails is a row whose moved continuation is empty (never decoded).
    """
    rows = []
    with torch_threads(1):
        for n in prompt_lens:
            prompt = make_prompt(n, ModelShape().vocab, seed=n)
            try:
                c = compare(pair.config, prompt, k, transfer=pair.transfer,
                            prefill_side=pair.prefill_side, decode_side=pair.decode_side,
                            device=pair.device)
            except TransferFailed as exc:
                log.error("prompt %d: %s", n, exc)
                ref = colocated(pair.config, prompt, k, device=pair.device)
                empty = Continuation([], ref.logits[:0], [], [])
                c = Comparison(n, ref, empty)
            rows.append(ServedRow(c, pair.records[-1]))
    return rows


def format_rows(rows: Sequence[ServedRow], transport: str) -> str:
    """The demo's table: per request, moved tokens beside colocated ones, bytes, time."""
    lines = [f"{'request':<8} {'prompt':>6}  {'continued (moved)':<40} "
             f"{'colocated':<40} {'equal':<5} {'bytes':>8} {'send->ok ms':>11}"]
    for row in rows:
        c, r = row.comparison, row.record
        moved = " ".join(map(str, c.moved.tokens)) or r.state
        lines.append(f"{r.request_id:<8} {c.seq_len:>6}  {moved:<40} "
                     f"{' '.join(map(str, c.reference.tokens)):<40} "
                     f"{'yes' if c.equal else 'NO':<5} {r.bytes:>8} "
                     f"{r.send_to_success_s * 1e3:>11.1f}")
    ok = sum(row.comparison.equal for row in rows)
    lines.append(f"{ok}/{len(rows)} continuations equal to the colocated run (tokens, logits, "
                 f"draft proposals); {sum(r.record.verified for r in rows)} transfers "
                 f"XXH3-128-verified; transport {transport}")
    return "\n".join(lines)
