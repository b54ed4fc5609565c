"""Fleet addresses and choice without daemons: dns: expansion, most-free decode, least-loaded
prefill, unreachable daemons set aside (kvbeam.fleet)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from kvbeam import fleet as fleet_mod
from kvbeam.client import Capacity
from kvbeam.errors import ConfigError, NoDaemon, PeerUnavailableError
from kvbeam.fleet import Members, expand_addresses, resolve_dns


def test_flags_repeat_and_comma_separate_without_duplicates() -> None:
    assert expand_addresses(["a:1,b:2", " c:3 ", "a:1"]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ConfigError, match="no daemon address"):
        expand_addresses([" , "])


def test_dns_form_gives_every_a_and_aaaa_record(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        assert (host, port) == ("kvbeam-decode.ns.svc", 50052)
        return [(socket.AF_INET, 1, 6, "", ("10.0.0.7", port)),
                (socket.AF_INET, 1, 6, "", ("10.0.0.5", port)),
                (socket.AF_INET6, 1, 6, "", ("fd00::9", port, 0, 0)),
                (socket.AF_INET, 1, 6, "", ("10.0.0.5", port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert resolve_dns("dns:kvbeam-decode.ns.svc:50052") == [
        "10.0.0.5:50052", "10.0.0.7:50052", "[fd00::9]:50052"]
    assert expand_addresses(["x:1,dns:kvbeam-decode.ns.svc:50052"])[:2] == [
        "x:1", "10.0.0.5:50052"]
    with pytest.raises(ConfigError, match="dns:HOST:PORT"):
        resolve_dns("dns:nohost")


def test_localhost_resolves() -> None:
    assert "127.0.0.1:9" in resolve_dns("dns:localhost:9")


class _Fake:
    """Stands in for a KvbeamClient: a fixed capacity or unreachable."""

    def __init__(self, address: str, free: int | None) -> None:
        self.address, self.free_slots, self.calls = address, free, 0

    def capacity(self) -> Capacity:
        self.calls += 1
        if self.free_slots is None:
            raise PeerUnavailableError(f"{self.address}: connection refused")
        return Capacity("i-" + self.address, 8, 8 - self.free_slots, 0)

    def close(self) -> None:
        pass


def _members(frees: dict[str, int | None]) -> tuple[Members, dict[str, _Fake]]:
    m = Members([])
    fakes = {a: _Fake(a, f) for a, f in frees.items()}
    m.members = [fleet_mod.Member(fake) for fake in fakes.values()]  # type: ignore[arg-type]
    return m, fakes


def test_decode_with_most_free_slots_is_picked_and_reservations_count() -> None:
    m, fakes = _members({"d0": 1, "d1": 3, "dead": None})
    picks = [m.pick_most_free().address for _ in range(4)]
    # d1 reports 3 free: it takes the first two; then both have 1 and share; then none.
    assert picks[:2] == ["d1", "d1"] and sorted(picks[2:]) == ["d0", "d1"]
    with pytest.raises(NoDaemon):
        m.pick_most_free()  # all taken until the next report (cached CAPACITY_TTL_S)
    assert fakes["dead"].calls == 1  # asked once, then set aside for DEAD_S
    assert all(x.address != "dead" for x in m.members if x.dead_until == 0)


def test_prefill_least_loaded_then_round_robin_and_excluded() -> None:
    m, _ = _members({"p0": 0, "p1": 0, "p2": 0})
    first = [m.pick_least_loaded() for _ in range(3)]
    assert sorted(x.address for x in first) == ["p0", "p1", "p2"]
    m.done(first[1])
    assert m.pick_least_loaded().address == first[1].address
    m.set_dead(first[0], "test")
    assert m.pick_least_loaded(exclude=[first[2].address]).address == first[1].address


def test_dns_members_follow_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pods that appear behind a dns: name join; vanished ones get no new requests and their
    channel closes once their last request ends; a failed lookup keeps the members."""
    answer: list[str] = ["10.0.0.1", "10.0.0.2"]
    closed: list[str] = []

    def fake_dns(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        if not answer:
            raise socket.gaierror("no such host")
        return [(socket.AF_INET, 1, 6, "", (ip, port)) for ip in answer]

    class Closing(_Fake):
        def close(self) -> None:
            closed.append(self.address)

    monkeypatch.setattr(socket, "getaddrinfo", fake_dns)
    monkeypatch.setattr(Members, "_member",
                        lambda self, a: fleet_mod.Member(Closing(a, 1)))  # type: ignore[arg-type]
    m = Members(["dns:kvbeam-prefill:50051"])
    assert [x.address for x in m.members] == ["10.0.0.1:50051", "10.0.0.2:50051"]
    busy = m.pick_least_loaded(exclude=["10.0.0.1:50051"])  # a request on .2, in flight
    m.resolve_again()  # too soon: nothing asked
    answer[:] = ["10.0.0.1", "10.0.0.3"]
    assert [x.address for x in m.members] == ["10.0.0.1:50051", "10.0.0.2:50051"]
    m.resolve_again(force=True)
    assert [x.address for x in m.members] == ["10.0.0.1:50051", "10.0.0.3:50051"]
    assert busy.retired and closed == []  # .2 still has a request: its channel stays open
    picked = {m.pick_least_loaded().address for _ in range(4)}
    assert picked == {"10.0.0.1:50051", "10.0.0.3:50051"}  # never the vanished one
    m.done(busy)
    assert closed == ["10.0.0.2:50051"]
    answer.clear()  # DNS down: keep what we have
    m.resolve_again(force=True)
    assert [x.address for x in m.members] == ["10.0.0.1:50051", "10.0.0.3:50051"]
    m.close()
    assert sorted(closed) == ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
