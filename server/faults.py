"""Test-only fault injection: off unless the daemon runs with ``--enable-fault-injection``.

A daemon builds its :class:`FaultHooks` only when started with the flag
(:func:`build_faults`, logged as a WARNING at start), and :func:`arm` is the one place
they enter it: they decorate the prefill driver's writer (:class:`FaultyWriter`) or
decode's landing check (:class:`CorruptingCheck`); no driver or core refers to a fault.
Without the flag every ``KVBEAM_FAULT_*`` variable is ignored, by name, in a WARNING.
With it, the variables choose the faults (each armed one is logged again). Unit tests
arm a driver with a :class:`FaultHooks` of their own. All fault logic lives here: the
transports' links carry no test-only member (the outside-MR fault swaps the link's view
of the peer's regions for an unchecked one). Five hooks:

Corrupt landed bytes (decode). Integrity checking is only worth its cost if it
catches corruption every time, and that needs corruption on demand.
``KVBEAM_FAULT_CORRUPT_LANDED=P`` (a fraction 0..1) makes decode flip one byte of a
request's landed items, after the completion arrived and before the digests are
recomputed, in about that fraction of requests. Each injection logs ``FAULT
INJECTED: corrupted ...`` so tests can count them against the integrity failures.
``KVBEAM_FAULT_SEED`` makes the choice reproducible.

Write outside the peer's memory (prefill). ``KVBEAM_FAULT_OUTSIDE_MR=PREFIX``: for
every request whose id starts with ``PREFIX``, the first block is aimed just past the
end of decode's lowest registered region and prefill's own bounds check is skipped
for that link (:func:`skip_remote_check`), so decode's RDMA device itself refuses
the write (``IBV_WC_REM_ACCESS_ERR``) and both queue pairs go to the error state, as
a corrupt address or rkey would make them. tests/rdma/test_faults_rdma.py uses it to
prove that such a request fails with the verbs status and that the next request
handshakes a fresh queue pair.

A slow wire (prefill). ``KVBEAM_FAULT_WRITE_DELAY_S=S`` makes prefill wait S seconds
after BeginWrite before posting each step's writes, as if the bytes took that long to
move: tests/host/test_slow_wire.py uses it to prove that decode's Transferring deadline,
sized by the request's bytes, does not fail a request that is still being written.

A broken link (prefill). ``KVBEAM_FAULT_BREAK_LINK=N`` (or ``N:PREFIX``, for requests
whose id starts with ``PREFIX`` only) breaks the data link just before the first
write of each of the first N steps (chunks, attempts) is posted: the TCP data socket
is shut, or the RDMA QP is moved to the error state, so that write fails with a
transport error as a dropped link or an RC QP whose retries ran out would make it.
Each break logs ``FAULT INJECTED: broke link``. tests/host/test_resend.py and
tests/rdma/test_resend_rdma.py use it to prove that the request is resent on a new
link (``--resend-retries``) and succeeds, and that a fault on every attempt fails it
after the retries, bounded.

A lying digest record (prefill). ``KVBEAM_FAULT_CORRUPT_RECORD=FIELD`` (or
``FIELD:PREFIX``, for requests whose id starts with ``PREFIX`` only) makes prefill
write every request's digest record (protocol 5, :mod:`kvbeam.pools.mailbox`) with
that field wrong and its self-digest recomputed, so decode's check of that very field
is what catches it: ``magic``, ``version``, ``count``, ``transfer_id``, ``slot``,
``request_id`` or ``digest`` (the first buffer's digest: the landed bytes then fail to
match it); ``self_digest`` flips a byte of the self-digest instead (a torn record).
Each logs ``FAULT INJECTED: digest record``. tests/host/test_integrity_mailbox.py uses it.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbeam.errors import ConfigError
from kvbeam.logs import fields
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import DIGEST_BYTES
from kvbeam.pools.mailbox import MAGIC, RECORD_VERSION, encode_record, request_hash
from kvbeam.pools.plan import IndexLists, list_for
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.decode_landing import LandingCheck
from kvbeam.server.core.incoming import LandingView
from kvbeam.server.core.prefill_driver import PrefillDriver, Writer
from kvbeam.server.state.peers import PeerConn
from kvbeam.transport.base import Link
from kvbeam.transport.blocks import AddressArray, Blocks
from kvbeam.transport.endpoint import Endpoint
from kvbeam.transport.regions import KeyArray, RegionTable

log = logging.getLogger(__name__)

CORRUPT_LANDED_ENV = "KVBEAM_FAULT_CORRUPT_LANDED"
SEED_ENV = "KVBEAM_FAULT_SEED"
OUTSIDE_MR_ENV = "KVBEAM_FAULT_OUTSIDE_MR"
WRITE_DELAY_ENV = "KVBEAM_FAULT_WRITE_DELAY_S"
BREAK_LINK_ENV = "KVBEAM_FAULT_BREAK_LINK"
CORRUPT_RECORD_ENV = "KVBEAM_FAULT_CORRUPT_RECORD"
#: The digest record's fields KVBEAM_FAULT_CORRUPT_RECORD may make wrong.
RECORD_FIELDS = ("magic", "version", "count", "transfer_id", "slot", "request_id", "digest",
                 "self_digest", "marks")
#: Every variable a fault reads (all start with this prefix).
FAULT_ENV_PREFIX = "KVBEAM_FAULT_"
#: The daemon flag without which no fault is armed.
ENABLE_FLAG = "--enable-fault-injection"


def build_faults(enabled: bool, environ: Mapping[str, str] | None = None) -> FaultHooks | None:
    """A daemon's fault hooks: None unless ``enabled`` (``--enable-fault-injection``).

    Without the flag every ``KVBEAM_FAULT_*`` variable is named in a WARNING and
    ignored: a production daemon with a stray variable in its environment keeps
    moving requests untouched. With it, a WARNING says fault injection is on before
    the variables are read (and refused when malformed).
    """
    env = os.environ if environ is None else environ
    if not enabled:
        for name in sorted(k for k in env if k.startswith(FAULT_ENV_PREFIX)):
            log.warning("%s is set but fault injection is off (no %s): ignored", name,
                        ENABLE_FLAG)
        return None
    log.warning("FAULT INJECTION ENABLED (%s): this daemon breaks things on purpose where a "
                "%s* variable asks; a test-only mode, never run it in production",
                ENABLE_FLAG, FAULT_ENV_PREFIX)
    return FaultHooks.from_env(env)


@dataclass
class FaultHooks:
    """The armed faults of one daemon (all off by default)."""

    corrupt_landed: float = 0.0
    seed: int = 0
    outside_mr_prefix: str = ""
    write_delay_s: float = 0.0
    break_links: int = 0
    break_prefix: str = ""
    corrupt_record_field: str = ""
    corrupt_record_prefix: str = ""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._broken = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultHooks:
        """Read the fault variables; refuse values that are not what they should be."""
        env = os.environ if environ is None else environ
        corrupt = 0.0
        raw = env.get(CORRUPT_LANDED_ENV)
        if raw is not None:
            try:
                corrupt = float(raw)
            except ValueError as exc:
                raise ConfigError(f"{CORRUPT_LANDED_ENV}: not a number: {raw!r}") from exc
            if not 0.0 <= corrupt <= 1.0:
                raise ConfigError(f"{CORRUPT_LANDED_ENV}: must be in 0..1 (got {raw})")
        seed = 0
        if SEED_ENV in env:
            try:
                seed = int(env[SEED_ENV])
            except ValueError as exc:
                raise ConfigError(f"{SEED_ENV}: not an integer: {env[SEED_ENV]!r}") from exc
        delay = 0.0
        if WRITE_DELAY_ENV in env:
            try:
                delay = float(env[WRITE_DELAY_ENV])
            except ValueError as exc:
                raise ConfigError(f"{WRITE_DELAY_ENV}: not a number: "
                                  f"{env[WRITE_DELAY_ENV]!r}") from exc
        breaks, _, prefix = env.get(BREAK_LINK_ENV, "0").partition(":")
        try:
            nbreaks = int(breaks)
        except ValueError as exc:
            raise ConfigError(f"{BREAK_LINK_ENV}: expected N or N:PREFIX, got "
                              f"{env[BREAK_LINK_ENV]!r}") from exc
        record_field, _, record_prefix = env.get(CORRUPT_RECORD_ENV, "").partition(":")
        if record_field and record_field not in RECORD_FIELDS:
            raise ConfigError(f"{CORRUPT_RECORD_ENV}: {record_field!r} is not one of "
                              f"{', '.join(RECORD_FIELDS)} (FIELD or FIELD:PREFIX)")
        hooks = cls(corrupt_landed=corrupt, seed=seed,
                    outside_mr_prefix=env.get(OUTSIDE_MR_ENV, ""), write_delay_s=delay,
                    break_links=max(0, nbreaks), break_prefix=prefix,
                    corrupt_record_field=record_field, corrupt_record_prefix=record_prefix)
        if hooks.corrupt_record_field:
            log.warning("FAULT INJECTION ARMED (%s=%s): digest records carry a wrong %s; "
                        "never run it in production", CORRUPT_RECORD_ENV,
                        env[CORRUPT_RECORD_ENV], record_field)
        if hooks.break_links:
            log.warning("FAULT INJECTION ARMED (%s=%s): the data link breaks before each of "
                        "the first %d writes; never run it in production", BREAK_LINK_ENV,
                        env[BREAK_LINK_ENV], hooks.break_links)
        if hooks.write_delay_s:
            log.warning("FAULT INJECTION ARMED (%s=%s): every write waits that long before it "
                        "is posted; never run it in production", WRITE_DELAY_ENV, delay)
        if hooks.corrupt_landed:
            log.warning("FAULT INJECTION ARMED (%s=%s): this daemon corrupts landed bytes on "
                        "purpose; never run it in production", CORRUPT_LANDED_ENV, corrupt)
        if hooks.outside_mr_prefix:
            log.warning("FAULT INJECTION ARMED (%s=%s): requests %s* will write outside the "
                        "peer's memory regions; never run it in production", OUTSIDE_MR_ENV,
                        hooks.outside_mr_prefix, hooks.outside_mr_prefix)
        return hooks

    @property
    def armed(self) -> bool:
        """True when any fault is switched on."""
        return (self.corrupt_landed > 0.0 or bool(self.outside_mr_prefix)
                or self.write_delay_s > 0.0 or self.break_links > 0
                or bool(self.corrupt_record_field))

    @property
    def hold_posting(self) -> bool:
        """True when a hook run before a write is posted may block (a delay sleeps, a
        broken link is a verbs call): prefill then posts on its executor only."""
        return self.write_delay_s > 0.0 or self.break_links > 0

    def writes_outside(self, request_id: str) -> bool:
        """True when this request's first block must miss the peer's memory (prefill)."""
        return bool(self.outside_mr_prefix) and request_id.startswith(self.outside_mr_prefix)

    def aim(self, request_id: str, link: Link, peer: Endpoint, blocks: Blocks) -> Blocks:
        """The blocks to post for this request: ``blocks``, or, where it must write
        outside the peer's memory, the same with the first one moved past it (prefill)."""
        if not self.writes_outside(request_id):
            return blocks
        return outside_peer_mr(link, peer, blocks)

    def slow_wire(self) -> None:
        """Wait ``write_delay_s`` before a write is posted (prefill; never under a lock)."""
        if self.write_delay_s > 0.0:
            time.sleep(self.write_delay_s)

    def break_link(self, request_id: str, link: Link) -> None:
        """Maybe break ``link`` just before a write of ``request_id`` is posted (prefill).

        Never under a lock: the QP's state change is a verbs call.
        """
        if self.break_links <= 0 or not request_id.startswith(self.break_prefix):
            return
        with self._lock:
            if self._broken >= self.break_links:
                return
            self._broken += 1
            n = self._broken
        how = _break(link)
        log.warning("FAULT INJECTED: broke link %d (%s) before a write of request %s "
                    "(%d/%d)", link.id, how, request_id, n, self.break_links,
                    extra=fields(request_id))

    def corrupt_record(self, request_id: str, raw: bytes, transfer_id: int, slot: int,
                       digests: bytes, marks: int = 0) -> bytes:
        """The digest record to write for this request: ``raw``, or one with the armed
        field wrong (its self-digest valid, except for ``self_digest``) (prefill)."""
        field = self.corrupt_record_field
        if not field or not request_id.startswith(self.corrupt_record_prefix):
            return raw
        if field == "self_digest":
            out = raw[:-1] + bytes([raw[-1] ^ 0xFF])
        else:
            # The first buffer's digest with its lowest bit flipped (little-endian).
            wrong = (bytes([digests[0] ^ 1]) + digests[1:] if field == "digest" and digests
                     else digests)
            out = encode_record(
                transfer_id + (field == "transfer_id"), slot + (field == "slot"), request_id,
                wrong, marks=marks + (field == "marks"), magic=MAGIC ^ (field == "magic"),
                version=RECORD_VERSION + (field == "version"),
                count=len(digests) // DIGEST_BYTES + 1 if field == "count" else None,
                rid_hash=request_hash(request_id) ^ 1 if field == "request_id" else None)
        log.warning("FAULT INJECTED: digest record of request %s written with a wrong %s",
                    request_id, field, extra=fields(request_id))
        return out

    def after_landing(self, request_id: str, side: AllocatedSide, indices: IndexLists,
                      draft: IndexLists | None = None, buffers: range | None = None) -> None:
        """Maybe flip one byte of one item this request moved (decode, before verifying).

        ``draft``: the draft's own lists (an engine's), which address the draft's
        buffers instead of ``indices``: the item is picked from the list that moved.
        ``buffers``: the flat buffers that landed (a sub-batch's, verified as it lands:
        the byte is flipped among them; None: every buffer). The chance applies to
        each call, so a request verified in sub-batches may be hit in several.
        """
        if self.corrupt_landed <= 0.0:
            return
        with self._lock:
            if self._rng.random() >= self.corrupt_landed:
                return
            flat = [(comp, buf) for comp in side.layout.components for buf in comp.buffers]
            picked = flat if buffers is None else [flat[i] for i in buffers]
            candidates = [(buf, moved) for comp, buf in picked
                          if len(moved := list_for(indices, draft, comp.pool, buf.index_kind))]
            if not candidates:
                return
            buf, moved = self._rng.choice(candidates)
            item = int(self._rng.choice(moved.tolist()))
            offset = self._rng.randrange(buf.item_len)
        items = side.buffer_array(buf).reshape(buf.items, buf.item_len)
        items[item, offset] = np.uint8(items[item, offset] ^ 0xFF)
        log.warning("FAULT INJECTED: corrupted request %s buffer %s item %d byte %d",
                    request_id, buf.name, item, offset, extra=fields(request_id))


def _break(link: Link) -> str:
    """Break a live link the way the wire would: shut its TCP socket, or error its QP."""
    unchecked: Any = link  # test-only reach into TcpLink._sock / VerbsLink._qps
    sock = getattr(unchecked, "_sock", None)
    if sock is not None:
        sock.shutdown(socket.SHUT_RDWR)
        return "TCP data socket shut"
    qps = list(getattr(unchecked, "_qps", ()))
    if qps:
        import pyverbs.enums as e
        from pyverbs.qp import QPAttr

        for qp in qps:  # every QP of the link, as a broken wire would
            qp.qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        return f"QP {', '.join(str(qp.qpn) for qp in qps)} moved to the error state"
    return "not a TCP or RDMA link: left alone"


class UncheckedRemote(RegionTable):
    """A peer's regions as a link sees them, minus the bounds check (fault injection only).

    Every block gets the key of the peer's lowest region, so a block outside that
    region is caught by the peer: its NIC (``IBV_WC_REM_ACCESS_ERR``) or its TCP
    receiver, never by us.
    """

    def __init__(self, checked: RegionTable) -> None:
        super().__init__((), f"{checked.name} (unchecked)")
        self._first_key = checked.first_key()

    def lookup(self, addrs: AddressArray, lengths: AddressArray) -> KeyArray:
        """The lowest region's key for every block, checking nothing."""
        return np.full(len(addrs), self._first_key, dtype=np.uint32)


def skip_remote_check(link: Link) -> None:
    """Let the peer, not ``link``, catch the link's writes that fall outside its regions.

    Only for a link that is doomed anyway (its QP goes to the error state with the
    first such write); works on the connected :class:`VerbsLink` and :class:`TcpLink`.
    """
    unchecked: Any = link  # fault injection's reach into the link's view of its peer
    peer = getattr(unchecked, "_peer", None)
    if not isinstance(peer, RegionTable):
        raise TypeError(f"link {link.id} ({type(link).__name__}) has no connected peer table")
    unchecked._peer = peer if isinstance(peer, UncheckedRemote) else UncheckedRemote(peer)


def outside_peer_mr(link: Link, peer: Endpoint, blocks: Blocks) -> Blocks:
    """``blocks`` with the first one moved just past the peer's lowest region, unchecked.

    The link is doomed once the write is posted (its QP goes to the error state), so
    switching its remote bounds check off (:func:`skip_remote_check`) affects no
    healthy traffic.
    """
    if not len(blocks) or not peer.regions:
        return blocks
    lowest = min(peer.regions, key=lambda r: r.addr)
    dst = blocks.dst.copy()
    dst[0] = np.uint64(lowest.addr + lowest.length)
    skip_remote_check(link)
    log.warning("FAULT INJECTED: writing %d bytes at %#x, just past decode's region %#x+%d",
                int(blocks.lengths[0]), int(dst[0]), lowest.addr, lowest.length)
    return Blocks(blocks.src, dst, blocks.lengths)


class FaultyWriter(Writer):
    """Prefill's :class:`~kvbeam.server.core.prefill_driver.Writer` with the armed faults
    around it. Before a step's first write: the slow wire sleeps, the write is aimed
    outside decode's memory, the link is broken (each where armed and the request
    matches); a digest record is encoded with its armed field wrong."""

    def __init__(self, inner: Writer, hooks: FaultHooks) -> None:
        self.inner = inner
        self.hooks = hooks

    @property
    def may_block(self) -> bool:
        """A delay sleeps and a broken link is a verbs call: the writes may block."""
        return self.inner.may_block or self.hooks.hold_posting

    def write(self, request_id: str, conn: PeerConn, transfer_id: int, blocks: Blocks, *,
              notify: bool, first: bool) -> None:
        """The write, after the step's faults when it is the step's first."""
        if first:
            self.hooks.slow_wire()
            blocks = self.hooks.aim(request_id, conn.link, conn.peer.endpoint, blocks)
            self.hooks.break_link(request_id, conn.link)
        self.inner.write(request_id, conn, transfer_id, blocks, notify=notify, first=first)

    def record(self, request_id: str, transfer_id: int, slot: int, digests: bytes,
               marks: int) -> bytes:
        """The inner writer's record, with the armed field wrong (where armed)."""
        raw = self.inner.record(request_id, transfer_id, slot, digests, marks)
        return self.hooks.corrupt_record(request_id, raw, transfer_id, slot, digests, marks)


class CorruptingCheck(LandingCheck):
    """Decode's :class:`~kvbeam.server.core.decode_landing.LandingCheck` that may flip a
    landed byte (``KVBEAM_FAULT_CORRUPT_LANDED``) just before the bytes are digested."""

    def __init__(self, inner: LandingCheck, hooks: FaultHooks) -> None:
        super().__init__(inner.memory, inner.integrity, inner.digest_pool, inner.clock)
        self.inner = inner
        self.hooks = hooks

    def before_digests(self, landing: LandingView, pools: AllocatedSide,
                       buffers: range | None) -> None:
        """Maybe flip a byte of one of ``buffers``' items this request moved, then the
        inner check's own step."""
        self.hooks.after_landing(landing.request_id, pools, landing.indices, landing.draft,
                                 buffers=buffers)
        self.inner.before_digests(landing, pools, buffers)


def arm(driver: PrefillDriver | DecodeDriver, hooks: FaultHooks) -> None:
    """Decorate ``driver`` with ``hooks``, the one place faults enter a daemon: prefill's
    writer (:class:`FaultyWriter`), decode's landing check (:class:`CorruptingCheck`).
    The daemon calls it at start (``--enable-fault-injection``, before it serves);
    unit tests call it on the drivers they build."""
    if isinstance(driver, PrefillDriver):
        driver.writer = FaultyWriter(driver.writer, hooks)
    else:
        driver.checker = CorruptingCheck(driver.checker, hooks)
