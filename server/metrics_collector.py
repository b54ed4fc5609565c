"""Metrics read at scrape time: levels (live transfers, slots, peers) and transport counters.

The transport keeps plain counters (:class:`kvbeam.transport.stats.TransportStats`)
and never imports a metrics library; :class:`DaemonCollector` turns a snapshot of
them, and of the daemon's tables, into metric families each time /metrics is
scraped. Nothing here runs on a transfer's path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvbeam.states import TransferState, TransferStatus
from kvbeam.transport.stats import TransportStats

_LIVE_STATES = [s for s in TransferState if not s.terminal]


@dataclass(frozen=True)
class Sources:
    """What the collector reads; plain callables so tests can pass fakes.

    ``slots`` returns (held, total) request slots, or is None on a side without
    slots (prefill).
    """

    info: Mapping[str, str]
    transport: Callable[[], TransportStats]
    live: Callable[[], Iterable[TransferStatus]]
    peers: Callable[[], int]
    slots: Callable[[], tuple[int, int]] | None = None
    #: Passes of the daemon's loop that took over ``STALL_WARN_S``.
    loop_stalls: Callable[[], int] | None = None


class DaemonCollector(Collector):
    """Yields kvbeam_info, transfer, slot, peer and kvbeam_transport_* families per scrape."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        """The families, from fresh snapshots of every source."""
        s = self.sources
        yield InfoMetricFamily("kvbeam", "This daemon: role, instance id, transport kind, "
                               "kvbeam version", value=dict(s.info))
        live = GaugeMetricFamily("kvbeam_transfers_live", "Transfers in a non-final state, "
                                 "by state", labels=["state"])
        counts = dict.fromkeys(_LIVE_STATES, 0)
        for status in s.live():
            counts[status.state] = counts.get(status.state, 0) + 1
        for state, n in counts.items():
            live.add_metric([state.value], n)
        yield live
        yield GaugeMetricFamily("kvbeam_peers", "Verified peers with an open connection",
                                value=s.peers())
        if s.slots is not None:
            held, total = s.slots()
            yield GaugeMetricFamily("kvbeam_slots_reserved", "Request slots held (reserved, "
                                    "transferring, or finished awaiting Release)", value=held)
            yield GaugeMetricFamily("kvbeam_slots", "Request slots in the pool", value=total)
        if s.loop_stalls is not None:
            yield CounterMetricFamily("kvbeam_loop_stalls", "Passes of the daemon's loop "
                                      "that took over 100 ms (every other source waited; "
                                      "the log names what the pass handled)",
                                      value=s.loop_stalls())
        yield from transport_families(s.transport())


def transport_families(t: TransportStats) -> Iterator[Metric]:
    """The kvbeam_transport_* families of one stats snapshot."""
    yield CounterMetricFamily("kvbeam_transport_sent_bytes", "Bytes of writes the peer "
                              "acknowledged (RDMA completion, TCP ACK)", value=t.sent_bytes)
    yield CounterMetricFamily("kvbeam_transport_sent_blocks", "Blocks of those writes, as "
                              "planned (before slicing into WRs or frames)", value=t.sent_blocks)
    completions = CounterMetricFamily("kvbeam_transport_write_completions", "Writes completed, "
                                      "by status (OK or the verbs/TCP status)", labels=["status"])
    for status, n in sorted(t.completions.items()):
        completions.add_metric([status], n)
    yield completions
    yield GaugeMetricFamily("kvbeam_transport_inflight_writes", "Writes queued or posted and "
                            "not yet completed", value=t.inflight_writes)
    yield CounterMetricFamily("kvbeam_transport_notifications", "Arrival notifications "
                              "received (a peer's transfer landed here)", value=t.notifications)
    failures = CounterMetricFamily("kvbeam_transport_link_failures", "Links that failed, by "
                                   "status (RDMA: QP errors such as IBV_WC_REM_ACCESS_ERR; TCP: "
                                   "broken streams; TIMEOUT: our own deadline)",
                                   labels=["status"])
    for status, n in sorted(t.link_failures.items()):
        failures.add_metric([status], n)
    yield failures
    yield GaugeMetricFamily("kvbeam_transport_links", "Transport links open", value=t.links)
    if t.received_bytes is not None:
        yield CounterMetricFamily("kvbeam_transport_received_bytes", "Bytes that landed in "
                                  "this side's regions (TCP only: RDMA WRITEs bypass this "
                                  "CPU)", value=t.received_bytes)
    if t.posted_wrs is not None:
        yield CounterMetricFamily("kvbeam_transport_posted_wrs", "RDMA work requests posted",
                                  value=t.posted_wrs)
    if t.inflight_wrs is not None:
        yield GaugeMetricFamily("kvbeam_transport_inflight_wrs", "RDMA work requests posted "
                                "and not yet completed", value=t.inflight_wrs)
