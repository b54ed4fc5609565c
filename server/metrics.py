"""A daemon's Prometheus metrics: instruments, the lifecycle observer, the /metrics endpoint.

Each daemon owns one :class:`DaemonMetrics` with its own ``CollectorRegistry``
(never the process-global one), so several daemons can live in one process, as
they do in tests. Three kinds of source feed it:

- transfer outcomes and latencies come from one place, the
  :class:`~kvbeam.server.state.lifecycle.TransferTable`'s ``on_change`` hook
  (:meth:`DaemonMetrics.on_change`); role code needs no metric calls for them.
  They and the offer counts change several times per request, so they are plain
  numbers under one lock, turned into families at scrape time (a prometheus_client
  ``inc`` or ``observe`` is several Python calls and a lock each), with the same
  names, series, values and ``_created`` samples as prometheus_client's own;
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
from bisect import bisect_left
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvbeam.logs import fields
from kvbeam.loop import DaemonLoop
from kvbeam.server.metrics_http import MetricsEndpoint
from kvbeam.states import FailureReason, TransferState, TransferStatus

log = logging.getLogger(__name__)

#: Latency buckets, seconds: from a loopback handshake (~1 ms) to a deadline (tens of s).
HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0)
TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)
#: The ``reason`` label of transfers that did not fail.
NO_REASON = "none"

_STARTED = ("kvbeam_transfers_started", "Transfers created on this side (prefill: Send; "
            "decode: Reserve)")
_FINISHED = ("kvbeam_transfers", "Transfers that reached a final state, by state and failure "
             "reason (reason 'none' for Success)")
_SECONDS = ("kvbeam_transfer_seconds", "Time from creation to the final state (prefill: Send "
            "to Success; decode: Reserve to Success), by final state")
_BYTES = ("kvbeam_request_bytes", "Bytes of transfers that reached Success (prefill: "
          "written; decode: landed, and verified when integrity is on)")
_OFFERS = ("kvbeam_offers", "Reservations decode offered ahead of Send, by event (decode: "
           "made, refused, failed; prefill: received, refused, used, missed: a single-chunk "
           "Send that found no offer and asked with BeginWrite)")
#: TRANSFER_BUCKETS with +Inf, as prometheus_client's Histogram bounds them, and their
#: ``le`` labels.
_BOUNDS = (*TRANSFER_BUCKETS, float("inf"))
_go_float: Callable[[float], str] = floatToGoString  # prometheus_client's, untyped there
_LE = tuple(_go_float(b) for b in _BOUNDS)


def _created() -> bool:
    """Whether ``_created`` samples are exported: prometheus_client's own switch
    (PROMETHEUS_DISABLE_CREATED_SERIES, ``disable_created_metrics()``), read per scrape
    as its metrics read it."""
    return prometheus_metrics._use_created


class _Count:
    """One counter series: its value (a float, as prometheus_client keeps it) and when
    the series was made (its ``_created``)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()


class _Timings:
    """One histogram series: per-bucket counts (not cumulative), their sum, ``_created``."""

    __slots__ = ("buckets", "created", "sum")

    def __init__(self) -> None:
        self.buckets = [0.0] * len(_BOUNDS)
        self.sum = 0.0
        self.created = time.time()


class _Families(Collector):
    """Families built at scrape time by ``build`` (``describe``: their names, so the
    registry's name checks and ``name[]`` filters see them)."""

    def __init__(self, build: Callable[[], list[Metric]]) -> None:
        self._build = build

    def collect(self) -> Iterator[Metric]:
        """The families with their samples."""
        yield from self._build()

    def describe(self) -> Iterator[Metric]:
        """The families, without samples."""
        for family in self._build():
            yield Metric(family.name, family.documentation, family.type)


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
        # The per-request series (see the module's docstring): plain numbers under one
        # lock (any thread changes them), declared up front so dashboards and rate() see
        # zeros, not gaps. Registered where their Counters were: the scrape's order.
        self._lock = threading.Lock()
        self._started = _Count()
        self._finished: dict[tuple[TransferState, FailureReason | None], _Count] = {
            (TransferState.SUCCESS, None): _Count()}
        for reason in FailureReason:
            self._finished[TransferState.FAILED, reason] = _Count()
        self._seconds = {state: _Timings()
                         for state in (TransferState.SUCCESS, TransferState.FAILED)}
        self._bytes = _Count()
        r.register(_Families(self._transfer_families))
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
        offer_events = (("received", "refused", "used", "missed") if role == "prefill"
                        else ("made", "refused", "failed"))
        self._offers = {event: _Count() for event in offer_events}
        r.register(_Families(self._offer_families))
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
        # Declare the series up front so dashboards and rate() see zeros, not gaps.
        side = "client" if role == "prefill" else "server"
        for result in ("ok", "failed"):
            self.handshakes.labels(side, result)
        self.handshake_seconds.labels(side)
        connect_results = (("ok", "failed") if role == "prefill"
                           else ("ok", "refused", "unreachable", "retry"))
        for result in connect_results:
            self.connects.labels(result)
        self._http: MetricsEndpoint | None = None

    # ---- sources -------------------------------------------------------------
    def on_change(self, status: TransferStatus) -> None:
        """The TransferTable observer: count creations and final states, time transfers."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s (version %d)", status.request_id, status.state.value,
                      status.version, extra=fields(status.request_id, status.peer))
        if status.version == 0:
            with self._lock:
                self._started.value += 1
            return
        if not status.state.terminal:
            return
        key = (status.state, status.reason)
        age = status.age_s
        with self._lock:
            finished = self._finished.get(key)
            if finished is None:  # Success with a reason: a series made at its first use
                finished = self._finished[key] = _Count()
            finished.value += 1
            timings = self._seconds[status.state]
            # The first bound at or above the age: the bucket Histogram.observe counts.
            timings.buckets[bisect_left(_BOUNDS, age)] += 1
            timings.sum += age
            if status.state is TransferState.SUCCESS:
                self._bytes.value += status.nbytes

    def count_offer(self, event: str) -> None:
        """Count an offer event (``kvbeam_offers_total{event}``)."""
        with self._lock:
            count = self._offers.get(event)
            if count is None:  # not a series we declare: made at its first use
                count = self._offers[event] = _Count()
            count.value += 1

    # ---- the per-request series, at scrape time ---------------------------------------
    def _transfer_families(self) -> list[Metric]:
        """kvbeam_transfers_started, kvbeam_transfers, kvbeam_transfer_seconds and
        kvbeam_request_bytes, as prometheus_client's Counters and Histogram expose them."""
        created = _created()
        started = CounterMetricFamily(*_STARTED)
        finished = CounterMetricFamily(*_FINISHED, labels=["state", "reason"])
        seconds = HistogramMetricFamily(*_SECONDS, labels=["state"])
        request_bytes = CounterMetricFamily(*_BYTES)
        with self._lock:
            started.add_metric([], self._started.value,
                               self._started.created if created else None)
            for (state, reason), count in self._finished.items():
                finished.add_metric(
                    [state.value, reason.value if reason is not None else NO_REASON],
                    count.value, count.created if created else None)
            for state, timings in self._seconds.items():
                cumulative, acc = [], 0.0
                for le, n in zip(_LE, timings.buckets, strict=True):
                    acc += n
                    cumulative.append((le, acc))
                seconds.add_metric([state.value], cumulative, timings.sum)
                if created:
                    seconds.samples.append(Sample(f"{_SECONDS[0]}_created",
                                                  {"state": state.value}, timings.created))
            request_bytes.add_metric([], self._bytes.value,
                                     self._bytes.created if created else None)
        return [started, finished, seconds, request_bytes]

    def _offer_families(self) -> list[Metric]:
        """kvbeam_offers, as prometheus_client's Counter exposes it."""
        created = _created()
        offers = CounterMetricFamily(*_OFFERS, labels=["event"])
        with self._lock:
            for event, count in self._offers.items():
                offers.add_metric([event], count.value, count.created if created else None)
        return [offers]

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
    def serve(self, address: str, loop: DaemonLoop | None = None) -> str:
        """Serve ``/metrics`` on ``HOST:PORT`` (port 0: any free port) on the daemon's
        ``loop`` (None: a loop of its own; :mod:`kvbeam.server.metrics_http`); returns the
        bound one.

        Raises ListenError when the address cannot be bound (port in use, not local).
        """
        endpoint = MetricsEndpoint(self.registry)
        bound = endpoint.serve(address, loop)
        self._http = endpoint
        log.info("metrics on http://%s/metrics", bound)
        return bound

    def stop(self) -> None:
        """Stop serving /metrics (idempotent)."""
        endpoint, self._http = self._http, None
        if endpoint is not None:
            endpoint.stop()
