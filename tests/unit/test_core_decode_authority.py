"""Decode's grant is authoritative: who may skip the drain, a landing under verification,
and engine pages that two live reservations would share (issue 22, item 4)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import pytest

from kvbeam.auth import Security
from kvbeam.errors import AlreadyLanded, BadIndexList
from kvbeam.pools.digest import request_digests
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.incoming import Landing
from kvbeam.server.peers.identity import claim_refusal
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport import Event, EventKind
from tests.core_fakes import land_record
from tests.engine_lists import kind_items, random_lists
from tests.unit.test_core_decode import PREFILL, _core, _relink


def test_an_abort_claiming_prefill_from_another_instance_still_drains_first() -> None:
    core, io, prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)  # prefill may write now
    st = core.abort("r", from_peer=True, detail="prefill says stop", instance_id="intruder")
    # Not the granted prefill: a scheduler's abort, so prefill is asked to drain first.
    assert st.state is TransferState.FAILED and st.reason is FailureReason.ABORTED
    assert core.slot_of("r") != -1, "slot freed on an impersonated Abort"
    assert prefill.aborts == []
    io.run_all()
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1


def test_an_abort_without_an_instance_id_is_no_prefill_report() -> None:
    core, io, prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    core.abort("r", from_peer=True, detail="", instance_id="")
    assert core.slot_of("r") != -1
    io.run_all()
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1


def test_the_granted_prefills_abort_frees_at_once() -> None:
    core, io, prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    st = core.abort("r", from_peer=True, detail="prefill failed: x", instance_id=conn.instance_id)
    assert st.state is TransferState.FAILED and st.reason is FailureReason.PEER_FAILED
    assert core.slot_of("r") == -1  # prefill drained before it said so
    io.run_all()
    assert prefill.aborts == []  # not echoed back


def test_a_relink_while_the_landing_is_verified_is_answered_already_landed() -> None:
    core, io, _prefill, conn = _core()
    res = core.reserve("r", 300, PREFILL)
    digests = request_digests(core.pools, res.indices)
    tid = core.begin_write("r", conn.instance_id, 300, True).transfer_id
    land_record(core, "r", digests)
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, tid))
    assert len(io.queue) == 1  # the verification is queued, not run yet
    _relink(core, conn)
    with pytest.raises(AlreadyLanded):  # no resend may reset what is being verified
        core.begin_write("r", conn.instance_id, 300, True)
    assert res.transfer_id == tid and res.landing is Landing.VERIFYING
    io.run_all()
    assert core.status("r").state is TransferState.SUCCESS


def test_a_landing_replaced_under_verification_is_never_advanced_to_success() -> None:
    core, io, _prefill, conn = _core()
    res = core.reserve("r", 300, PREFILL)
    # Digests follow (a landing without them is settled on the event thread at once).
    tid = core.begin_write("r", conn.instance_id, 300, True).transfer_id
    land_record(core, "r", request_digests(core.pools, res.indices))
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, tid))
    assert len(io.queue) == 1
    # What any path that replaces the landing does (a relink does this):
    core.core._by_transfer.pop(res.transfer_id)
    res.transfer_id, res.landing = tid + 100, Landing.AWAITED
    core.core._by_transfer[res.transfer_id] = "r"
    io.run_all()  # the verification of the old landing finishes only now
    assert core.status("r").state is TransferState.TRANSFERRING, \
        "a replaced landing was advanced to Success"


def _disjoint(first: dict[IndexKind, np.ndarray], items: dict[IndexKind, int]
              ) -> dict[IndexKind, np.ndarray]:
    """Lists of the same lengths as ``first`` that share none of its items."""
    out = {}
    for kind, arr in first.items():
        taken = set(arr.tolist())
        out[kind] = np.array([i for i in range(items[kind]) if i not in taken][:len(arr)],
                             dtype=np.int64)
    return out


def test_two_live_reservations_may_not_share_an_engine_page() -> None:
    core, io, _prefill, _conn = _core()
    first = random_lists(core.spec, core.layout, 300, np.random.default_rng(1))
    core.reserve("a", 300, PREFILL, indices=first)
    second = _disjoint(first, kind_items(core.layout))
    shared = int(first[IndexKind.KV_PAGES][0])
    second[IndexKind.KV_PAGES][1] = shared  # one KV page of "a", nothing else
    slots_before = core.slots.free
    with pytest.raises(BadIndexList) as err:
        core.reserve("b", 300, PREFILL, indices=second)
    text = str(err.value)
    assert "request b" in text and "request a" in text and str(shared) in text, text
    assert err.value.kind == IndexKind.KV_PAGES.value and err.value.index == shared
    assert err.value.position == 1
    # Refused before anything was held: no slot, no table entry.
    assert core.slots.free == slots_before and core.table.get("b") is None
    core.abort("a", from_peer=False, detail="scheduler")
    io.run_all()
    core.reserve("b", 300, PREFILL, indices=second)  # the page is free again
    assert core.status("b").state is TransferState.BOOTSTRAPPING


def test_a_slot_based_reservation_may_not_take_an_engine_requests_pages() -> None:
    core, _io, _prefill, _conn = _core()
    slot_based = core.reserve("s", 300, PREFILL)  # slot 0's pages
    used = kind_items(core.layout)
    engine = {k: v.copy() for k, v in slot_based.indices.items() if k in used}
    with pytest.raises(BadIndexList) as err:
        core.reserve("e", 300, PREFILL, indices=engine)
    assert "request s" in str(err.value)


def test_the_draft_pools_items_are_owned_too() -> None:
    core, _io, _prefill, _conn = _core()
    rng = np.random.default_rng(3)
    draft = random_lists(core.spec, core.layout, 300, rng, pool="draft")
    first = random_lists(core.spec, core.layout, 300, rng)
    core.reserve("a", 300, PREFILL, indices=first, draft=draft)
    second = _disjoint(first, kind_items(core.layout))  # the target's items all differ
    kind = next(iter(draft))
    with pytest.raises(BadIndexList) as err:  # but the draft's own lists are the same
        core.reserve("b", 300, PREFILL, indices=second, draft=draft)
    assert err.value.pool == "draft" and err.value.kind == kind.value
    assert "request a" in str(err.value) and f"draft {kind.value}" in str(err.value)


def test_a_draft_list_may_not_take_what_a_slot_based_reservation_writes_in_the_draft() -> None:
    core, _io, _prefill, _conn = _core()
    slot_based = core.reserve("s", 300, PREFILL)  # its draft buffers use the target lists
    draft_kinds = kind_items(core.layout, pool="draft")
    target = _disjoint({k: v for k, v in slot_based.indices.items()
                        if k in kind_items(core.layout)}, kind_items(core.layout))
    draft = {k: slot_based.indices[k].copy() for k in draft_kinds}  # the slot's own items
    with pytest.raises(BadIndexList) as err:
        core.reserve("e", 300, PREFILL, indices=target, draft=draft)
    assert err.value.pool == "draft" and "request s" in str(err.value)


def test_a_granted_instance_that_is_no_longer_verified_cannot_skip_the_drain() -> None:
    core, io, prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    core.peers.forget(conn.instance_id)  # e.g. replaced by a restart being processed
    core.abort("r", from_peer=True, detail="x", instance_id=conn.instance_id)
    assert core.slot_of("r") != -1
    io.run_all()
    assert prefill.aborts == ["r"]


# ---- who may speak for the granted prefill: the Abort's caller's credentials ------------
TOKEN = Security(token="t")


def _caller(peer: str, security: Security = TOKEN,
            auth: dict[str, list[bytes]] | None = None) -> Callable[[str], str | None]:
    """The check the servicer binds to an Abort's caller (the handshake's own rule)."""
    return functools.partial(claim_refusal, security=security, peer=peer, auth=auth or {},
                             call="Abort")


def test_an_abort_naming_the_granted_instance_from_another_host_still_drains_first(
        caplog: pytest.LogCaptureFixture) -> None:
    core, io, prefill, conn = _core()  # the granted prefill's control address is PREFILL
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    # Instance ids are not secrets (every Heartbeat answer carries one): a token holder
    # calling from ::1 names the real instance, but 127.0.0.1 is where prefill is.
    with caplog.at_level(logging.WARNING, "kvbeam.server.core.decode"):
        st = core.abort("r", from_peer=True, detail="prefill says stop",
                        instance_id=conn.instance_id, caller_refusal=_caller("ipv6:[::1]:4444"))
    assert st.reason is FailureReason.ABORTED
    assert core.slot_of("r") != -1, "slot freed on an Abort from another host"
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "::1" in warning and PREFILL in warning, warning  # names the caller and prefill
    io.run_all()
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1


def test_an_abort_from_the_granted_prefills_own_host_frees_at_once() -> None:
    core, io, prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    st = core.abort("r", from_peer=True, detail="prefill failed: x",
                    instance_id=conn.instance_id, caller_refusal=_caller("ipv4:127.0.0.1:4444"))
    assert st.reason is FailureReason.PEER_FAILED and core.slot_of("r") == -1
    io.run_all()
    assert prefill.aborts == []


def test_under_mtls_the_callers_certificate_must_name_the_prefills_host() -> None:
    mtls = Security(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem")  # never read
    core, io, prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    rogue = {"peer_dns": [b"rogue.example"], "peer_ip": [b"10.9.9.9"]}
    core.abort("r", from_peer=True, detail="x", instance_id=conn.instance_id,
               caller_refusal=_caller("ipv4:127.0.0.1:4444", mtls, rogue))
    assert core.slot_of("r") != -1  # same host, but its certificate names another
    io.run_all()
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1
    core.reserve("s", 300, PREFILL)
    core.begin_write("s", conn.instance_id, 300, False)
    real = {"peer_dns": [b"localhost"], "peer_ip": [b"127.0.0.1"]}
    core.abort("s", from_peer=True, detail="x", instance_id=conn.instance_id,
               caller_refusal=_caller("ipv4:10.1.1.1:4444", mtls, real))
    assert core.slot_of("s") == -1  # its certificate names prefill's host
