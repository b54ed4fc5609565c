"""A small reference scheduler: drive requests through a prefill/decode pair.

For each request: Reserve on decode, Send on prefill, wait for decode's terminal
state (Success only once the completion proved every byte landed and, with
integrity on, the CRC32C digests matched), check prefill's, Release on decode.
Used by ``kvbeam drive``, ``kvbeam demo`` and the compose scheduler service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient, Status
from kvbeam.errors import Busy, KvbeamError
from kvbeam.logs import fields
from kvbeam.pools.engine_indices import ListLike
from kvbeam.states import VERIFIED_PREFIX, TransferState

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

    @property
    def ok(self) -> bool:
        """True when decode reported Success."""
        return self.state == TransferState.SUCCESS.value

    @property
    def verified(self) -> bool:
        """True when decode's Success says every moved buffer's CRC32C matched prefill's."""
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
        prefill.send(request_id, source_slot, seq_len, decode.address, indices=src_indices)
        final: Status = decode.wait(request_id, timeout)
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


def drive(prefill_address: str, decode_address: str, seq_lens: Sequence[int], *,
          source_slots: int, concurrency: int = 4, timeout: float = 60.0,
          prefix: str = "req", security: Security | None = None) -> list[RequestResult]:
    """Run requests of the given lengths, ``concurrency`` at a time, with ``security``."""
    with KvbeamClient(prefill_address, security=security) as prefill, \
            KvbeamClient(decode_address, security=security) as decode:
        def one(i: int) -> RequestResult:
            return run_request(prefill, decode, f"{prefix}-{i}", seq_lens[i],
                               i % source_slots, timeout=timeout)

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, range(len(seq_lens))))


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
    lines.append(f"{ok}/{len(results)} Success ({verified} CRC32C-verified), {total} bytes"
                 + (f", transport {transport}" if transport else ""))
    return "\n".join(lines)
