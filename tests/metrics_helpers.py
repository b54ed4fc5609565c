"""Reading Prometheus metrics in tests: scrape an endpoint or a registry into a flat dict."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_until

#: (sample name, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a text exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(address: str, timeout: float = 10.0) -> Samples:
    """GET http://ADDRESS/metrics and parse it."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
        return parse(reply.read().decode())


def collect(registry: CollectorRegistry) -> Samples:
    """A registry's samples, as a scrape would see them."""
    return parse(generate_latest(registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a counter not incremented yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    """How much a sample moved between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)


def settle(address: str, done: Callable[[Samples], bool], timeout: float = 10.0) -> Samples:
    """Scrape until ``done`` holds (outcome counters move just after the state a client
    sees); returns that scrape."""
    last: list[Samples] = [scrape(address)]

    def check() -> bool:
        last[0] = scrape(address)
        return done(last[0])

    assert wait_until(check, timeout, interval=0.1), "metrics did not settle"
    return last[0]


def succeeded_once_more(before: Samples) -> Callable[[Samples], bool]:
    """A ``settle`` condition: one more Success than in ``before``."""
    return lambda s: delta(s, before, "kvbeam_transfers_total", state="Success",
                           reason="none") >= 1
