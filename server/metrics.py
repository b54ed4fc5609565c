"""A daemon's Prometheus metrics: instruments, the lifecycle observer, the /metrics endpoint.

Each daemon owns one :class:`DaemonMetrics` with its own ``CollectorRegistry``
(never the process-global one), so several daemons can live in one process, as
they do in tests. Three kinds of source feed it:

- transfer outcomes and latencies come from one place, the
  :class:`~kvbeam.server.state.lifecycle.TransferTable`'s ``on_change`` hook
  (:meth:`DaemonMetrics.on_change`); role code needs no metric calls for them;
- handshake latency from :meth:`DaemonMetrics.handshake` around each handshake;
- everything that is a level or lives in the transport (live transfers, slots,
  peers, transport counters) is read at scrape time by
  :class:`~kvbeam.server.metrics_collector.DaemonCollector`.

The metric names and their meaning are listed in docs/metrics.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from kvbeam.errors import ListenError
from kvbeam.logs import fields
from kvbeam.states import FailureReason, TransferState, TransferStatus

log = logging.getLogger(__name__)

#: Latency buckets, seconds: from a loopback handshake (~1 ms) to a deadline (tens of s).
HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0)
TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)
#: The ``reason`` label of transfers that did not fail.
NO_REASON = "none"


class DaemonMetrics:
    """The instruments of one daemon and the hooks that update them.

    Args:
        role: "prefill" or "decode" (decides which handshake side is pre-declared).
        registry: where to register (a fresh ``CollectorRegistry`` by default).
    """

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.started = Counter(
            "kvbeam_transfers_started", "Transfers created on this side (prefill: Send; "
            "decode: Reserve)", registry=r)
        self.finished = Counter(
            "kvbeam_transfers", "Transfers that reached a final state, by state and failure "
            "reason (reason 'none' for Success)", ["state", "reason"], registry=r)
        self.seconds = Histogram(
            "kvbeam_transfer_seconds", "Time from creation to the final state (prefill: Send "
            "to Success; decode: Reserve to Success), by final state", ["state"],
            buckets=TRANSFER_BUCKETS, registry=r)
        self.request_bytes = Counter(
            "kvbeam_request_bytes", "Bytes of transfers that reached Success (prefill: "
            "written; decode: landed, and verified when integrity is on)", registry=r)
        self.handshakes = Counter(
            "kvbeam_handshakes", "Handshakes by side (client: this side asked; server: a "
            "peer asked) and result (ok, failed)", ["side", "result"], registry=r)
        self.rpc_refusals = Counter(
            "kvbeam_rpc_refusals", "Transfer RPCs answered with an error status, by method "
            "and gRPC code (RESOURCE_EXHAUSTED: back-pressure; INTERNAL: a bug)",
            ["method", "code"], registry=r)
        self.resends = Counter(
            "kvbeam_resends", "Requests prefill resent on a new link after a transient "
            "transport error (see --resend-retries)", registry=r)
        self.begin_writes = Counter(
            "kvbeam_begin_writes", "BeginWrite calls prefill made (one per chunk of a request "
            "that found no offer from decode)", registry=r)
        self.offers = Counter(
            "kvbeam_offers", "Reservations decode offered ahead of Send, by event (decode: "
            "made, refused, failed; prefill: received, refused, used, missed: a single-chunk "
            "Send that found no offer and asked with BeginWrite)", ["event"], registry=r)
        self.declines = Counter(
            "kvbeam_declines", "Requests decode's engine declined (DECLINE: it will not load "
            "them) that decode's daemon told their prefill of, by Abort", registry=r)
        self.connects = Counter(
            "kvbeam_connects", "Decode-initiated pairings: decode asked a prefill daemon to "
            "handshake with it (Connect), by result (decode: ok, refused: prefill's "
            "handshake was refused and the reservations failed at once, unreachable, "
            "retry: an older or busy prefill; prefill: ok, failed)", ["result"], registry=r)
        self.handshake_seconds = Histogram(
            "kvbeam_handshake_seconds", "Handshake latency (client: the whole round trip; "
            "server: decoding, verification and link set-up)", ["side"],
            buckets=HANDSHAKE_BUCKETS, registry=r)
        # Declare the series up front so dashboards and rate() see zeros, not gaps, and
        # keep the per-request ones: labels() is a dozen Python calls, paid per request.
        self._finished: dict[tuple[TransferState, FailureReason | None], Counter] = {
            (TransferState.SUCCESS, None): self.finished.labels(TransferState.SUCCESS.value,
                                                                NO_REASON)}
        for reason in FailureReason:
            self._finished[TransferState.FAILED, reason] = self.finished.labels(
                TransferState.FAILED.value, reason.value)
        self._seconds = {state: self.seconds.labels(state.value)
                         for state in (TransferState.SUCCESS, TransferState.FAILED)}
        side = "client" if role == "prefill" else "server"
        for result in ("ok", "failed"):
            self.handshakes.labels(side, result)
        self.handshake_seconds.labels(side)
        offer_events = (("received", "refused", "used", "missed") if role == "prefill"
                        else ("made", "refused", "failed"))
        self._offers = {event: self.offers.labels(event) for event in offer_events}
        connect_results = (("ok", "failed") if role == "prefill"
                           else ("ok", "refused", "unreachable", "retry"))
        for result in connect_results:
            self.connects.labels(result)
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    # ---- sources -------------------------------------------------------------
    def on_change(self, status: TransferStatus) -> None:
        """The TransferTable observer: count creations and final states, time transfers."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s (version %d)", status.request_id, status.state.value,
                      status.version, extra=fields(status.request_id, status.peer))
        if status.version == 0:
            self.started.inc()
            return
        if not status.state.terminal:
            return
        finished = self._finished.get((status.state, status.reason))
        if finished is None:  # Success with a reason: not a series we declare
            reason = status.reason.value if status.reason is not None else NO_REASON
            finished = self.finished.labels(status.state.value, reason)
        finished.inc()
        self._seconds[status.state].observe(status.age_s)
        if status.state is TransferState.SUCCESS:
            self.request_bytes.inc(status.nbytes)

    def count_offer(self, event: str) -> None:
        """Count an offer event (``kvbeam_offers_total{event}``)."""
        counter = self._offers.get(event)
        (counter if counter is not None else self.offers.labels(event)).inc()

    def count_connect(self, result: str) -> None:
        """Count a decode-initiated pairing's outcome (``kvbeam_connects_total{result}``)."""
        self.connects.labels(result).inc()

    @contextmanager
    def handshake(self, side: str) -> Iterator[None]:
        """Time the handshake in the ``with`` body; an exception counts it as failed."""
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.handshakes.labels(side, "failed").inc()
            raise
        finally:
            self.handshake_seconds.labels(side).observe(time.perf_counter() - start)
        self.handshakes.labels(side, "ok").inc()

    # ---- the endpoint ------------------------------------------------------------
    def serve(self, address: str) -> str:
        """Serve ``/metrics`` on ``HOST:PORT`` (port 0: any free port); returns the bound one.

        Raises ListenError when the address cannot be bound (port in use, not local).
        """
        host, _, port = address.rpartition(":")
        bind = host[1:-1] if host.startswith("[") else host
        try:
            server, thread = start_http_server(int(port), addr=bind, registry=self.registry)
        except OSError as exc:
            raise ListenError(f"cannot serve metrics on {address}: {exc.strerror or exc}; "
                              "pick another --metrics port (0: any free port)") from exc
        self._http = (server, thread)
        bound = f"{host}:{server.server_port}"
        log.info("metrics on http://%s/metrics", bound)
        return bound

    def stop(self) -> None:
        """Stop serving /metrics (idempotent)."""
        http, self._http = self._http, None
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
