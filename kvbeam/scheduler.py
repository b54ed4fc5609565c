"""A small reference scheduler: drive requests through prefill/decode daemons.

For each request: Reserve on decode, Send on prefill, wait for decode's terminal
state (Success only once the completion proved every byte landed and, with
integrity on, the XXH3-128 digests matched), check prefill's, Release on decode.
Used by ``kvbeam drive``, ``kvbeam demo`` and the compose scheduler service.

With several daemons (:class:`~kvbeam.fleet.Fleet`) each request goes to the decode
with the most free slots and the least loaded prefill, and a request whose decode
or prefill died, restarted or lost its link is re-reserved and resent elsewhere
under a new attempt id, at most ``max_attempts`` times (docs/fleet.md).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient, Status
from kvbeam.errors import Busy, KvbeamError, NoDaemon, PeerError, UnknownRequest
from kvbeam.fleet import Fleet, Member, expand_addresses
from kvbeam.logs import fields
from kvbeam.pools.engine_indices import ListLike
from kvbeam.states import VERIFIED_PREFIX, FailureReason, TransferState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome, as the scheduler saw it."""

    request_id: str
    seq_len: int
    decode_slot: int
    state: str
    bytes: int
    seconds: float
    send_to_success_s: float
    prefill_state: str
    detail: str = ""
    attempts: int = 1  # fleet: 1 + resends after a daemon died, restarted or lost its link
    recovery_s: float = 0.0  # fleet: first failed attempt's end to the final outcome
    prefill: str = ""  # fleet: the daemons of the last attempt
    decode: str = ""
    attempt_id: str = ""  # fleet: the request id the last attempt used on the daemons

    @property
    def ok(self) -> bool:
        """True when decode reported Success."""
        return self.state == TransferState.SUCCESS.value

    @property
    def verified(self) -> bool:
        """True when decode's Success says every moved buffer's XXH3-128 matched prefill's."""
        return self.ok and self.detail.startswith(VERIFIED_PREFIX)


def run_request(prefill: KvbeamClient, decode: KvbeamClient, request_id: str, seq_len: int,
                source_slot: int, *, timeout: float = 60.0, release: bool = True,
                busy_retry_s: float = 30.0, src_indices: Mapping[str, ListLike] | None = None,
                dst_indices: Mapping[str, ListLike] | None = None) -> RequestResult:
    """Move one request end to end and report what happened (never raises for a failure).

    ``src_indices``/``dst_indices``: the engines' own lists on prefill and decode
    (docs/indices.md), by kind name; without them the lists are the slots'.
    """
    t0 = time.monotonic()
    deadline = t0 + busy_retry_s
    slot = -1
    try:
        while True:
            try:
                slot = decode.reserve(request_id, seq_len, prefill.address,
                                      indices=dst_indices).slot
                break
            except Busy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # back-pressure: decode has no free slot right now
        t_send = time.monotonic()
        # Decode's watch opens while Send travels: no second call setup after Send returns.
        with decode.open_watch(request_id, timeout) as watch:
            prefill.send(request_id, source_slot, seq_len, decode.address, indices=src_indices)
            final: Status = watch.wait()
        t_done = time.monotonic()
        pstat = prefill.wait(request_id, min(timeout, 10.0))
        if final.state is TransferState.SUCCESS and release:
            decode.release(request_id)
        return RequestResult(request_id, seq_len, slot, str(final), final.bytes_total,
                             t_done - t0, t_done - t_send, str(pstat),
                             final.detail if final.state is TransferState.SUCCESS else "")
    except KvbeamError as exc:
        log.warning("request %s: %s", request_id, exc, extra=fields(request_id))
        return RequestResult(request_id, seq_len, slot, f"error: {exc}", 0,
                             time.monotonic() - t0, 0.0,
                             _prefill_outcome(prefill, request_id, min(timeout, 10.0)))


def _prefill_outcome(prefill: KvbeamClient, request_id: str, timeout: float) -> str:
    """Prefill's final word on a request the scheduler lost track of (e.g. decode died):
    its terminal state, or "?" when prefill never saw the request or cannot be asked."""
    try:
        return str(prefill.wait(request_id, timeout))
    except KvbeamError:
        return "?"


#: Decode's final reasons that say a daemon died, restarted or lost its link: worth a resend.
RESENDABLE = frozenset({FailureReason.PEER_FAILED, FailureReason.PEER_UNREACHABLE,
                        FailureReason.TRANSPORT_ERROR, FailureReason.TIMEOUT,
                        FailureReason.SHUTDOWN})
#: Pause between tries while every decode is full or unreachable, s.
PICK_PAUSE_S = 0.05


def _quiet_abort(client: KvbeamClient, request_id: str, detail: str) -> Status | None:
    """Abort on one side, best effort (the daemon may be the one that died)."""
    try:
        return client.abort(request_id, detail)
    except KvbeamError:
        return None


def _reserve(fleet: Fleet, request_id: str, seq_len: int,
             deadline: float) -> tuple[Member, Member, int]:
    """(prefill, decode, slot): a reservation on the decode with the most free slots for the
    least loaded prefill; full or unreachable decodes are skipped until ``deadline``."""
    while True:
        prefill = decode = None
        try:
            prefill = fleet.prefills.pick_least_loaded()
            decode = fleet.decodes.pick_most_free()
            slot = decode.client.reserve(request_id, seq_len, prefill.address).slot
            return prefill, decode, slot
        except NoDaemon:
            pass
        except Busy:
            assert decode is not None
            fleet.decodes.set_full(decode)
        except PeerError as exc:  # nothing was sent: no attempt spent
            assert decode is not None
            fleet.decodes.set_dead(decode, str(exc))
        except KvbeamError:  # a refusal (BadRequest, ...): give the picks back, report it
            _give_back(fleet, prefill, decode)
            raise
        _give_back(fleet, prefill, decode)
        if time.monotonic() > deadline:
            raise NoDaemon(f"request {request_id}: no decode took it within the busy window")
        time.sleep(PICK_PAUSE_S)


def _give_back(fleet: Fleet, prefill: Member | None, decode: Member | None) -> None:
    """Undo the load counted by the picks of an attempt that did not go ahead."""
    if prefill is not None:
        fleet.prefills.done(prefill)
    if decode is not None:
        fleet.decodes.done(decode)


def _attempt(fleet: Fleet, prefill: Member, decode: Member, rid: str, seq_len: int,
             source_slot: int, slot: int, timeout: float) -> tuple[RequestResult, bool]:
    """Send a reserved request and wait for decode's verdict: (result, worth a resend)."""
    t_send = time.monotonic()
    p, d = prefill.client, decode.client
    # Decode's watch is set up while Send travels (see run_request); `with` closes it
    # however the attempt ends.
    with d.open_watch(rid, timeout) as watch:
        try:
            p.send(rid, source_slot, seq_len, d.address)
        except PeerError as exc:  # prefill died or restarted: the reservation is for nothing
            fleet.prefills.set_dead(prefill, str(exc))
            _quiet_abort(d, rid, "prefill unreachable; resending elsewhere")
            return _failed(rid, seq_len, slot, f"error: {exc}", "?", t_send), True
        try:
            final: Status | None = watch.wait()
        except (PeerError, UnknownRequest) as exc:
            # Decode died, restarted (forgot rid), or blipped. Abort there so this attempt
            # can never end in Success later; a decode that answers gives its verdict (an
            # abort after Success says Success and frees the slot).
            final = _quiet_abort(d, rid, "scheduler lost the request; resending elsewhere")
            if final is None:
                fleet.decodes.set_dead(decode, str(exc))
                _quiet_abort(p, rid, "decode unreachable; resending elsewhere")
                return _failed(rid, seq_len, slot, f"error: {exc}", "?", t_send), True
    assert final is not None  # mypy: the except branch returned or set it
    if not final.terminal:
        # Past the timeout: abort, as above.
        final = _quiet_abort(d, rid, "scheduler timeout; resending elsewhere") or final
    t_done = time.monotonic()
    if final.state is TransferState.SUCCESS:
        # Already freed if the abort above found Success; else decode's hand-off lease frees it.
        with contextlib.suppress(KvbeamError):
            d.release(rid)
        return RequestResult(rid, seq_len, slot, str(final), final.bytes_total,
                             t_done - t_send, t_done - t_send,
                             _prefill_outcome(p, rid, min(timeout, 10.0)), final.detail), False
    pstate = _prefill_outcome(p, rid, 1.0)
    if pstate == "?":  # prefill gone too: leave it out of the next pick
        fleet.prefills.set_dead(prefill, f"no answer about {rid}")
    resend = final.state is not TransferState.FAILED or final.reason in RESENDABLE
    return _failed(rid, seq_len, slot, str(final), pstate, t_send), resend


def _failed(rid: str, seq_len: int, slot: int, state: str, pstate: str,
            t0: float) -> RequestResult:
    return RequestResult(rid, seq_len, slot, state, 0, time.monotonic() - t0, 0.0, pstate)


def run_fleet_request(fleet: Fleet, request_id: str, seq_len: int, source_slot: int, *,
                      timeout: float = 60.0, max_attempts: int = 4,
                      busy_retry_s: float = 30.0) -> RequestResult:
    """Move one request through the fleet, resending after a daemon failure (never raises).

    Attempt ``k`` > 0 uses the id ``REQUEST.rK`` on the daemons (ids are unique per
    pair, and the old attempt's id is spent on its prefill). An attempt is given up
    only once it cannot reach Success any more: decode reported Failed, was aborted,
    or is unreachable; so at most one attempt of a request ends in Success.
    """
    t0 = time.monotonic()
    first_failure: float | None = None
    result: RequestResult | None = None
    for k in range(max(1, max_attempts)):
        rid = request_id if k == 0 else f"{request_id}.r{k}"
        try:
            prefill, decode, slot = _reserve(fleet, rid, seq_len, time.monotonic() + busy_retry_s)
        except KvbeamError as exc:  # NoDaemon, or a request decode refuses (BadRequest)
            log.warning("request %s: %s", rid, exc, extra=fields(rid))
            result = _failed(rid, seq_len, -1, f"error: {exc}", "?", t0)
            break
        try:
            result, resend = _attempt(fleet, prefill, decode, rid, seq_len, source_slot, slot,
                                      timeout)
        except KvbeamError as exc:  # a refusal (BadRequest, ...): resending cannot help
            _quiet_abort(decode.client, rid, f"scheduler: {exc}")
            result, resend = _failed(rid, seq_len, slot, f"error: {exc}", "?", t0), False
        finally:
            _give_back(fleet, prefill, decode)
        result = replace(result, prefill=prefill.address, decode=decode.address)
        if result.ok or not resend:
            break
        first_failure = first_failure or time.monotonic()
        log.warning("request %s: attempt %d on %s -> %s ended %s; resending", request_id, k + 1,
                    prefill.address, decode.address, result.state, extra=fields(rid))
    assert result is not None
    now = time.monotonic()
    return replace(result, request_id=request_id, attempt_id=result.request_id,
                   attempts=k + 1, seconds=now - t0,
                   recovery_s=now - first_failure if first_failure is not None else 0.0)


def drive(prefill_address: str | Sequence[str], decode_address: str | Sequence[str],
          seq_lens: Sequence[int], *, source_slots: int, concurrency: int = 4,
          timeout: float = 60.0, prefix: str = "req", security: Security | None = None,
          max_attempts: int = 4) -> list[RequestResult]:
    """Run requests of the given lengths, ``concurrency`` at a time, with ``security``.

    Each address may be a list, comma-separated, or ``dns:HOST:PORT``
    (:func:`~kvbeam.fleet.expand_addresses`). One prefill and one decode: each request
    runs once on that pair (:func:`run_request`). More: :func:`run_fleet_request`.
    """
    prefill_specs = [prefill_address] if isinstance(prefill_address, str) else prefill_address
    decode_specs = [decode_address] if isinstance(decode_address, str) else decode_address
    prefills, decodes = expand_addresses(prefill_specs), expand_addresses(decode_specs)
    # dns: names may resolve to more daemons later (pods scale): only the fleet re-resolves.
    dynamic = any("dns:" in s for s in [*prefill_specs, *decode_specs])
    if len(prefills) == 1 and len(decodes) == 1 and not dynamic:
        with KvbeamClient(prefills[0], security=security) as prefill, \
                KvbeamClient(decodes[0], security=security) as decode:
            def one(i: int) -> RequestResult:
                return run_request(prefill, decode, f"{prefix}-{i}", seq_lens[i],
                                   i % source_slots, timeout=timeout)

            with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
                return list(pool.map(one, range(len(seq_lens))))
    with Fleet(prefill_specs, decode_specs, security=security) as fleet:
        def fleet_one(i: int) -> RequestResult:
            return run_fleet_request(fleet, f"{prefix}-{i}", seq_lens[i], i % source_slots,
                                     timeout=timeout, max_attempts=max_attempts)

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(fleet_one, range(len(seq_lens))))


def format_table(results: Sequence[RequestResult], transport: str = "") -> str:
    """The per-request table the demo prints."""
    lines = [f"{'request':<12} {'tokens':>7} {'slot':>4} {'bytes':>10} {'ms':>8} "
             f"{'send->ok ms':>11}  state (decode / prefill)"]
    for r in results:
        lines.append(f"{r.request_id:<12} {r.seq_len:>7} {r.decode_slot:>4} {r.bytes:>10} "
                     f"{r.seconds * 1e3:>8.1f} {r.send_to_success_s * 1e3:>11.1f}  "
                     f"{r.state} / {r.prefill_state}")
    ok = sum(r.ok for r in results)
    verified = sum(r.verified for r in results)
    total = sum(r.bytes for r in results if r.ok)
    lines.append(f"{ok}/{len(results)} Success ({verified} XXH3-128-verified), {total} bytes"
                 + (f", transport {transport}" if transport else ""))
    retried = [r for r in results if r.attempts > 1]
    if retried:
        lines.append(f"{len(retried)} resent after a daemon failure "
                     f"({sum(r.attempts - 1 for r in retried)} resends), recovery max "
                     f"{max(r.recovery_s for r in retried) * 1e3:.0f} ms")
    return "\n".join(lines)
