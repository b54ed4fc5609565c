"""Several prefill and decode daemons behind one scheduler: addresses, liveness and choice.

A deployment is never one pair. :func:`expand_addresses` turns what an operator
gives (repeated flags, comma-separated lists, ``dns:HOST:PORT`` for every A/AAAA
record of HOST, which is what a Kubernetes headless Service resolves to) into
control addresses. A :class:`Members` set keeps one client per daemon and picks:

* a **decode** by free capacity as the daemon reports it (Heartbeat's slot counts,
  one cheap round trip, cached for :data:`CAPACITY_TTL_S` and lowered by the
  reservations this scheduler made since), so load follows real free slots;
* a **prefill** by least load (this scheduler's requests in flight on it), ties
  broken round robin.

A daemon that cannot be reached is set aside for :data:`DEAD_S` and then tried
again, so a restarted one (same address) rejoins by itself. ``dns:`` names are
resolved again every :data:`RESOLVE_EVERY_S` when a pick comes (no thread): pods
that appear join, pods that vanish get no new requests and their channels close
once their last request here ends. The retry policy that
uses this lives in :mod:`kvbeam.scheduler`; docs/fleet.md describes both.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient
from kvbeam.errors import ConfigError, KvbeamError, NoDaemon

log = logging.getLogger(__name__)

#: How long a daemon that could not be reached is left out before it is tried again, s.
DEAD_S = 1.0
#: How long a decode's reported capacity is trusted before it is asked again, s.
CAPACITY_TTL_S = 0.25
#: How often ``dns:`` addresses are resolved again (pods come and go), s.
RESOLVE_EVERY_S = 5.0


def _host_port(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def resolve_dns(spec: str) -> list[str]:
    """``dns:HOST:PORT`` as one address per A/AAAA record of HOST (sorted, no duplicates).

    A Kubernetes headless Service name resolves to the ready pods' addresses, so this
    finds every daemon behind it without a registry of our own.
    """
    host, sep, port = spec.removeprefix("dns:").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{spec!r}: expected dns:HOST:PORT")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"{spec!r}: cannot resolve {host}: {exc}") from None
    return sorted({_host_port(str(info[4][0]), int(port)) for info in infos})


def expand_addresses(specs: Iterable[str]) -> list[str]:
    """Control addresses from flags: each may be comma-separated and may be ``dns:HOST:PORT``.

    Order is kept and duplicates dropped; an empty result raises :class:`ConfigError`.
    """
    out: list[str] = []
    for spec in specs:
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            for address in resolve_dns(item) if item.startswith("dns:") else [item]:
                if address not in out:
                    out.append(address)
    if not out:
        raise ConfigError(f"no daemon address in {list(specs)!r}")
    return out


@dataclass
class Member:
    """One daemon as the scheduler sees it (fields guarded by :class:`Members`' lock)."""

    client: KvbeamClient
    inflight: int = 0  # this scheduler's requests on it now
    retired: bool = False  # its address left the DNS answer: no new requests
    dead_until: float = 0.0  # monotonic time before which it is not picked
    free: int = 0  # decode: free slots at the last report, less reservations since
    reported_at: float = field(default=-1e9)  # monotonic time of that report

    @property
    def address(self) -> str:
        """The daemon's control address."""
        return self.client.address


class Members:
    """The daemons of one role, one client each, and how the scheduler picks among them."""

    def __init__(self, specs: Sequence[str], *, security: Security | None = None,
                 timeout: float = 5.0) -> None:
        """``specs``: addresses as :func:`expand_addresses` takes them (``dns:`` included)."""
        self._specs = list(specs)
        self._security, self._timeout = security, timeout
        self._dynamic = any(item.strip().startswith("dns:")
                            for spec in self._specs for item in spec.split(","))
        #: Replaced, never changed in place, so a reader without the lock sees a whole list.
        self.members = ([self._member(a) for a in expand_addresses(self._specs)]
                        if self._specs else [])
        self._retired: list[Member] = []
        self._resolved_at = time.monotonic()
        self._lock = threading.Lock()
        self._turn = itertools.count()

    def _member(self, address: str) -> Member:
        return Member(KvbeamClient(address, security=self._security, timeout=self._timeout))

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            everyone = self.members + self._retired
        for m in everyone:
            m.client.close()

    def resolve_again(self, *, force: bool = False) -> None:
        """Resolve ``dns:`` addresses again when :data:`RESOLVE_EVERY_S` has passed: new ones
        join, vanished ones retire. A failed lookup keeps the members as they are."""
        now = time.monotonic()
        with self._lock:
            if not self._dynamic or (not force and now - self._resolved_at < RESOLVE_EVERY_S):
                return
            self._resolved_at = now  # claimed: other pickers go on with the current list
        try:
            wanted = expand_addresses(self._specs)  # DNS: never under the lock
        except ConfigError as exc:
            log.warning("resolving %s again failed, keeping %d daemons: %s",
                        ", ".join(self._specs), len(self.members), exc)
            return
        idle: list[Member] = []
        with self._lock:
            known = {m.address: m for m in self.members}
            gone = [m for a, m in known.items() if a not in wanted]
            joined = {a: self._member(a) for a in wanted if a not in known}
            self.members = [known.get(a) or joined[a] for a in wanted]
            for m in gone:
                m.retired = True
                (idle if m.inflight == 0 else self._retired).append(m)
        for m in idle:
            m.client.close()
        if gone or joined:
            log.info("daemons behind %s now: %s (left: %s)", ", ".join(self._specs),
                     ", ".join(m.address for m in self.members) or "none",
                     ", ".join(m.address for m in gone) or "none")

    def __enter__(self) -> Members:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _candidates(self, exclude: Iterable[str]) -> list[Member]:
        now = time.monotonic()
        skip = set(exclude)
        return [m for m in self.members if m.address not in skip and m.dead_until <= now]

    def pick_least_loaded(self, exclude: Iterable[str] = ()) -> Member:
        """The reachable daemon with the fewest of our requests in flight (ties: round robin);
        counts the new request on it (pair with :meth:`done`)."""
        self.resolve_again()
        with self._lock:
            cands = self._candidates(exclude)
            if not cands:
                raise NoDaemon("no reachable daemon: " + ", ".join(m.address for m in self.members))
            turn = next(self._turn)
            n = len(cands)
            best = min(range(n), key=lambda i: (cands[i].inflight, (i - turn) % n))
            member = cands[best]
            member.inflight += 1
            return member

    def pick_most_free(self, exclude: Iterable[str] = ()) -> Member:
        """The reachable decode with the most free slots as reported (refreshed when stale);
        counts the reservation about to be made on it (pair with :meth:`done`)."""
        self.resolve_again()
        now = time.monotonic()
        with self._lock:
            stale = [m for m in self._candidates(exclude)
                     if now - m.reported_at > CAPACITY_TTL_S]
            for m in stale:  # claimed: other threads use the old figure meanwhile
                m.reported_at = now
        for m in stale:  # no lock across the round trips
            self._refresh(m)
        with self._lock:
            cands = [m for m in self._candidates(exclude) if m.free > 0]
            if not cands:
                raise NoDaemon("no decode with a free slot among " +
                               ", ".join(m.address for m in self._candidates(exclude)))
            turn = next(self._turn)
            n = len(cands)
            best = max(range(n), key=lambda i: (cands[i].free, -((i - turn) % n)))
            member = cands[best]
            member.free -= 1
            member.inflight += 1
            return member

    def _refresh(self, m: Member) -> None:
        try:
            cap = m.client.capacity()
        except KvbeamError as exc:
            self.set_dead(m, str(exc))
            return
        with self._lock:
            m.free = cap.free
            m.reported_at = time.monotonic()

    def done(self, member: Member) -> None:
        """A request picked on ``member`` ended there (whatever the outcome)."""
        with self._lock:
            member.inflight = max(0, member.inflight - 1)
            closing = member.retired and member.inflight == 0 and member in self._retired
            if closing:
                self._retired.remove(member)
        if closing:  # its address left the DNS answer and its last request here ended
            member.client.close()

    def set_full(self, member: Member) -> None:
        """Decode said Busy: take it as full until its next report."""
        with self._lock:
            member.free = 0

    def set_dead(self, member: Member, why: str) -> None:
        """``member`` could not be reached: leave it out for :data:`DEAD_S`."""
        with self._lock:
            member.dead_until = time.monotonic() + DEAD_S
            member.reported_at = -1e9  # ask again once it is back
        log.warning("daemon %s set aside for %.1f s: %s", member.address, DEAD_S, why)


class Fleet:
    """The prefill and decode daemons one scheduler drives (see :mod:`kvbeam.scheduler`)."""

    def __init__(self, prefills: Sequence[str], decodes: Sequence[str], *,
                 security: Security | None = None, timeout: float = 5.0) -> None:
        """Addresses of each role as :func:`expand_addresses` takes them (``dns:`` included)."""
        self.prefills = Members(prefills, security=security, timeout=timeout)
        self.decodes = Members(decodes, security=security, timeout=timeout)

    def close(self) -> None:
        """Close every channel."""
        self.prefills.close()
        self.decodes.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
