"""The digest mailbox (protocol 5): the record's layout and checks, the advert, the
staging free-list, and prefill's record write (its accounting and its staging slot)."""

from __future__ import annotations

from typing import cast

import pytest

from kvbeam.errors import ConfigError, RecordError
from kvbeam.pools.digest import request_digests
from kvbeam.pools.indices import request_indices
from kvbeam.pools.mailbox import (
    HEADER,
    MAGIC,
    Advert,
    Expected,
    FreeSlots,
    Record,
    RecordArea,
    encode_record,
    mailbox_region,
    parse_advert,
    parse_record,
    record_bytes,
    record_size,
)
from kvbeam.server.faults import CORRUPT_RECORD_ENV, RECORD_FIELDS, FaultHooks
from kvbeam.states import TransferState
from kvbeam.transport import Link
from kvbeam.transport.endpoint import RemoteRegion
from tests.core_fakes import FakeLink, flip_digest, prefill_core, slot_lists, wait_for
from tests.fixtures import UNIFIED_TARGET

DIGEST_VALUES = [(i + 1) * 0x0123456789ABCDEF0123456789ABCDEF % (1 << 128) for i in range(5)]
#: As digest_many gives them: 16 little-endian bytes each.
DIGESTS = b"".join(d.to_bytes(16, "little") for d in DIGEST_VALUES)
WANT = Expected(buffers=5, transfer_id=77, slot=3, request_id="req-1")
ADDR = "127.0.0.1:9"


def _record(**kw: object) -> bytes:
    return encode_record(77, 3, "req-1", DIGESTS, **kw)  # type: ignore[arg-type]


def test_a_record_round_trips_and_has_the_documented_layout() -> None:
    raw = _record()
    assert len(raw) == record_size(5) == 24 + 5 * 16 + 16
    assert raw[:4] == b"KVDR" and HEADER.unpack_from(raw)[:6] == (MAGIC, 2, 0, 5, 77, 3)
    assert int.from_bytes(raw[24:40], "little") == DIGEST_VALUES[0]
    assert raw[24:24 + 5 * 16] == DIGESTS
    # a slot's padding is ignored
    assert parse_record(raw + b"\0" * 40, WANT) == Record(DIGESTS, 0)
    marked = _record(marks=3)
    assert raw[5] == 0 and marked[5] == 3 and parse_record(marked, WANT).marks == 3
    assert record_bytes(5) == 128 and record_bytes(0) == 64 and record_bytes(182) == 2944 + 64


@pytest.mark.parametrize(("raw", "field", "values"), [
    (_record(magic=0), "magic", "0x00000000, expected 0x5244564b"),
    (_record(version=1), "version", "1, expected 2"),  # protocol 5's record
    (_record(count=4), "count", "4 digests, expected 5"),
    (encode_record(78, 3, "req-1", DIGESTS), "transfer_id", "78, expected 77"),
    (encode_record(77, 4, "req-1", DIGESTS), "slot", "4, expected 3"),
    (encode_record(77, 3, "req-2", DIGESTS), "request_id", "expected"),
    (encode_record(77, 3, "req-1", DIGESTS[:4 * 16]), "count", "4 digests, expected 5"),
    (b"KVDR", "length", "4 bytes"),
])
def test_each_wrong_field_is_refused_naming_it_and_both_values(raw: bytes, field: str,
                                                               values: str) -> None:
    with pytest.raises(RecordError) as err:
        parse_record(raw, WANT)
    assert err.value.field == field and values in err.value.detail, str(err.value)
    assert str(err.value).startswith(f"digest record: {field}: ")


def test_a_torn_record_fails_its_self_digest() -> None:
    raw = bytearray(_record())
    raw[40] ^= 0x10  # a byte of the second digest: landed torn, or overwritten
    with pytest.raises(RecordError) as err:
        parse_record(bytes(raw), WANT)
    assert err.value.field == "self_digest" and "torn or stale" in err.value.detail
    raw = bytearray(_record())
    raw[-1] ^= 1
    with pytest.raises(RecordError, match="self_digest"):
        parse_record(bytes(raw), WANT)


def test_a_record_cut_short_by_its_slot_is_refused() -> None:
    with pytest.raises(RecordError, match="length: a record of 5 digests needs 120 bytes"):
        parse_record(_record()[:100], WANT)


def test_the_advert_is_checked_against_the_layout_and_decodes_regions() -> None:
    regions = (RemoteRegion(0x1000, 0x1000, 1), RemoteRegion(0x10000, 128 * 8, 2))
    advert = parse_advert(f"{0x10000}:128:8", 5, regions)
    assert advert == Advert(0x10000, 128, 8) and advert.slot_addr(2) == 0x10000 + 256
    assert mailbox_region(advert, regions) is regions[1]
    assert mailbox_region(None, regions) is None
    for text, why in [("1:2", "expected ADDR:RECORD_BYTES:SLOTS"),
                      ("x:128:8", "expected ADDR:RECORD_BYTES:SLOTS"),
                      (f"{0x10000}:64:8", "needs 120"),
                      (f"{0x10000}:128:0", "expected 1.."),
                      (f"{0x10000}:128:9", "lie in none of the 2 regions"),
                      (f"{0x1D00}:128:8", "lie in none")]:
        with pytest.raises(RecordError, match=why) as err:
            parse_advert(text, 5, regions)
        assert err.value.field == "mailbox"


def test_a_record_area_clears_a_slots_header_and_reads_a_copy() -> None:
    area = RecordArea.for_buffers(4, 5)
    assert area.record_bytes == 128 and area.region.length == 512
    area.put(2, _record())
    assert area.has_record(2) and not area.has_record(1)
    assert parse_record(area.read(2), Expected(5, 77, 3, "req-1")).digests == DIGESTS
    area.clear(2)
    assert not area.has_record(2)
    with pytest.raises(RecordError, match="magic"):
        parse_record(area.read(2), WANT)
    with pytest.raises(IndexError):
        area.read(4)
    with pytest.raises(ValueError, match="do not fit"):
        area.put(0, b"\0" * 129)
    area.close()


def test_the_staging_free_list_gives_the_lowest_slot_and_refuses_a_double_free() -> None:
    free = FreeSlots(3)
    assert [free.take(), free.take()] == [0, 1] and free.held == 2
    free.give(0)
    assert free.take() == 0
    assert free.take() == 2 and free.take() is None
    free.give(1)
    with pytest.raises(ValueError, match="not held"):
        free.give(1)
    assert free.take() == 1


@pytest.mark.parametrize("field", RECORD_FIELDS)
def test_the_fault_hook_makes_exactly_its_field_wrong(field: str) -> None:
    hooks = FaultHooks.from_env({CORRUPT_RECORD_ENV: f"{field}:req-"})
    assert hooks.armed
    raw = hooks.corrupt_record("req-1", _record(), 77, 3, DIGESTS)
    if field == "digest":  # a valid record whose first digest is wrong
        assert parse_record(raw, WANT).digests == flip_digest(DIGESTS)
    elif field == "marks":  # a valid record counting a mark that never came
        assert parse_record(raw, WANT) == Record(DIGESTS, 1)
    else:
        with pytest.raises(RecordError) as err:
            parse_record(raw, WANT)
        assert err.value.field == field
    assert hooks.corrupt_record("other", _record(), 77, 3, DIGESTS) == _record()
    with pytest.raises(ConfigError, match=CORRUPT_RECORD_ENV):
        FaultHooks.from_env({CORRUPT_RECORD_ENV: "nonsense"})


# ---- prefill's record write ------------------------------------------------------------
def _posted(integrity: bool = True) -> tuple[object, FakeLink]:
    core, _fake = prefill_core(integrity=integrity)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    link = cast(FakeLink, conn.link)
    assert wait_for(lambda: len(link.writes) == (2 if integrity else 1))
    return core, link


def test_the_record_is_the_last_write_and_success_waits_for_it() -> None:
    core, link = _posted()
    from kvbeam.server.core.prefill_driver import PrefillDriver
    assert isinstance(core, PrefillDriver)
    tid = link.writes[0][0]
    assert link.writes == [(tid, False), (tid, True)]
    assert len(link.blocks[1]) == 1 and int(link.blocks[1].lengths[0]) == record_size(
        len(core.layout.flat_buffers))
    want = request_digests(core.pools, request_indices(UNIFIED_TARGET, 0, 300))
    assert parse_record(link.records[0][1],
                        Expected(len(want) // 16, tid, 0, "r")) == Record(want, 0)
    assert core.core.records.free is not None and core.core.records.free.held == 1
    core.on_event(link.completion(tid))
    assert core.status("r").state is TransferState.TRANSFERRING and core.in_flight("r") == 1
    assert core.core.records.free.held == 1  # the record's write still reads its slot
    core.on_event(link.completion(tid))
    assert core.status("r").state is TransferState.SUCCESS
    assert core.core.records.free.held == 0  # given back once no write of it is outstanding
    facts = core.facts_of("r")
    done, total = facts.bytes_done, facts.bytes_total
    assert done == total > 0  # the record is not counted as the request's bytes


def test_integrity_off_writes_no_record_and_notifies_the_data() -> None:
    core, link = _posted(integrity=False)
    from kvbeam.server.core.prefill_driver import PrefillDriver
    assert isinstance(core, PrefillDriver)
    assert link.writes == [(link.writes[0][0], True)] and link.records == []
    core.on_event(link.completion(link.writes[0][0]))
    assert core.status("r").state is TransferState.SUCCESS


def test_a_record_that_cannot_be_posted_fails_the_request_and_frees_its_slot() -> None:
    core, fake = prefill_core()

    class NoRecord(FakeLink):
        def write(self, transfer_id: int, blocks: object, notify: bool = True) -> None:
            if notify:
                raise ValueError("the record write is refused")
            super().write(transfer_id, blocks, notify)  # type: ignore[arg-type]

    real = fake.connect

    def connect(address: str) -> object:
        conn = real(address)
        conn.link = cast(Link, NoRecord())
        return conn

    fake.connect = connect  # type: ignore[method-assign,assignment]
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    assert wait_for(lambda: core.status("r").state is TransferState.FAILED)
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    link = cast(FakeLink, conn.link)
    assert core.in_flight("r") == 1  # the data write still reads the source
    core.on_event(link.completion(link.writes[0][0]))
    assert core.status("r").state is TransferState.FAILED  # never Success without it
    assert core.in_flight("r") == 0
    assert core.core.records.free is not None and core.core.records.free.held == 0
    assert wait_for(lambda: fake.aborts == ["r"])


def test_digests_done_inline_put_the_record_at_the_end_of_the_datas_own_write() -> None:
    """A small request's digests run on the calling thread (nothing to overlap): one
    write, notified, whose last block is the record; one completion ends it."""
    from kvbeam.pools.digest_pool import DigestPool
    from kvbeam.server.core.prefill_driver import PrefillDriver

    core, _fake = prefill_core()
    assert isinstance(core, PrefillDriver)
    core.digest_pool = DigestPool(0)  # inline, as any job under INLINE_BELOW_BYTES
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    link = cast(FakeLink, conn.link)
    assert wait_for(lambda: len(link.writes) == 1)
    tid = link.writes[0][0]
    assert link.writes == [(tid, True)] and len(link.records) == 1
    assert conn.mailbox is not None
    assert int(link.blocks[0].dst[-1]) == conn.mailbox.slot_addr(0)
    core.on_event(link.completion(tid))
    assert core.status("r").state is TransferState.SUCCESS
    assert core.core.records.free is not None and core.core.records.free.held == 0
    facts = core.facts_of("r")
    done, total = facts.bytes_done, facts.bytes_total
    assert done == total > 0
