"""The digest mailbox: a request's digest record (with its sub-batch marks), in band.

With integrity on, prefill RDMA-writes the request's digest record into decode's
*mailbox* (one slot per decode request slot) as the last write of the request's
final chunk, the write the completion marker (WRITE WITH IMMEDIATE, TCP notify)
follows: the marker proves that the record and the bytes it describes landed
together, and no Digests message travels (docs/protocol.md, "The digest mailbox").

A record, little-endian throughout:

======  =====  ==============================================================
offset  bytes  field
======  =====  ==============================================================
0       4      magic ``KVDR`` (the bytes ``K V D R``)
4       1      version (:data:`RECORD_VERSION`)
5       1      marks: sub-batches written and notified before the record
               (:mod:`kvbeam.pools.sub_batches`; 0: none, the request is digested whole)
6       2      buffer count n
8       4      transfer id (the grant's, the marker's immediate)
12      4      decode's mailbox slot
16      8      XXH3-64 of the request id (UTF-8)
24      16 n   the request's XXH3-128 digests, one per buffer, in layout order
24+16n  16     XXH3-128 of every byte before it (a torn or stale record fails it)
======  =====  ==============================================================

A slot is :func:`record_bytes` long: the record's size rounded up to 64 bytes.
Everything here is pure (no transport, no lock) except :class:`RecordArea`, the
memory of a mailbox or of prefill's staging slots (an anonymous mapping), and
:class:`FreeSlots`, the staging slots' free-list (its owner's lock guards it).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvbeam.errors import RecordError
from kvbeam.pools.digest import DIGEST_BYTES
from kvbeam.transport.endpoint import Region, RemoteRegion

#: The record's magic, the bytes ``KVDR`` read as a little-endian u32.
MAGIC = int.from_bytes(b"KVDR", "little")
#: The record layout's version (bump for any change of a field's meaning or place): one
#: byte, the marks count the next.
RECORD_VERSION = 2
#: magic, version, marks, n, transfer id, slot, request id hash.
HEADER = struct.Struct("<IBBHIIQ")
#: Where the marks count sits in a record (after the magic and the version byte).
MARKS_OFFSET = 5
#: Slots are a multiple of this many bytes.
ALIGN = 64
#: The endpoint ``extra`` key decode advertises its mailbox under: ``addr:record_bytes:slots``.
MAILBOX_KEY = "kvbeam-mailbox"
#: The most buffers a record carries (the u16 count), and the largest slot accepted.
MAX_BUFFERS = 0xFFFF
MAX_RECORD_BYTES = -(-(HEADER.size + DIGEST_BYTES * (MAX_BUFFERS + 1)) // ALIGN) * ALIGN
#: The most mailbox slots a peer may advertise (decode's request slots).
MAX_SLOTS = 1 << 20

Bytes = np.ndarray[Any, np.dtype[np.uint8]]

__all__ = ["RecordError"]  # raised here, defined with every kvbeam error


def record_size(n: int) -> int:
    """Bytes of a record of ``n`` digests (header, digests, self-digest)."""
    return HEADER.size + DIGEST_BYTES * n + DIGEST_BYTES


def record_bytes(n: int) -> int:
    """A mailbox slot's size for ``n`` buffers: the record rounded up to 64 bytes."""
    return -(-record_size(n) // ALIGN) * ALIGN


def request_hash(request_id: str) -> int:
    """XXH3-64 of the request id's UTF-8 bytes."""
    return int(xxhash.xxh3_64_intdigest(request_id.encode()))


def _self_digest(body: bytes | memoryview) -> bytes:
    return int(xxhash.xxh3_128_intdigest(body)).to_bytes(DIGEST_BYTES, "little")


def encode_record(transfer_id: int, slot: int, request_id: str, digests: bytes, *,
                  marks: int = 0, magic: int = MAGIC, version: int = RECORD_VERSION,
                  count: int | None = None, rid_hash: int | None = None) -> bytes:
    """The record of a request's digests (16 little-endian bytes per buffer, as
    :func:`kvbeam.pools.digest.digest_many` gives them); ``marks``: its sub-batches
    notified before it (the other keyword arguments exist for fault injection and tests:
    a record that lies about one field, its self-digest valid)."""
    n, rest = divmod(len(digests), DIGEST_BYTES)
    if rest:
        raise ValueError(f"{len(digests)} bytes of digests: not {DIGEST_BYTES} per buffer")
    if n > MAX_BUFFERS:
        raise ValueError(f"{n} digests: a record carries at most {MAX_BUFFERS}")
    if not 0 <= marks <= 0xFF:
        raise ValueError(f"{marks} marks: a record counts 0..255")
    head = HEADER.pack(magic, version, marks, n if count is None else count,
                       transfer_id & 0xFFFFFFFF, slot & 0xFFFFFFFF,
                       request_hash(request_id) if rid_hash is None else rid_hash)
    body = head + digests
    return body + _self_digest(body)


@dataclass(frozen=True)
class Expected:
    """What decode expects of a request's record (its own books, not the peer's)."""

    buffers: int
    transfer_id: int
    slot: int
    request_id: str


@dataclass(frozen=True)
class Record:
    """A checked record: the request's digests (16 little-endian bytes per buffer, in
    layout order), and the sub-batches marked before it."""

    digests: bytes
    marks: int


def parse_record(raw: bytes | memoryview, want: Expected) -> Record:
    """The digests (and marks count) of a record that passes every check against ``want``.

    Raises:
        RecordError: naming the first field that fails, with both values (the magic,
            version and count first, then the self-digest, then the identity fields).
    """
    raw = bytes(raw)
    if len(raw) < HEADER.size:
        raise RecordError("length", f"{len(raw)} bytes, a record needs at least {HEADER.size}")
    magic, version, marks, n, tid, slot, rid_hash = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise RecordError("magic", f"{magic:#010x}, expected {MAGIC:#010x} (KVDR): no record "
                                   "was written into the slot, or another one overwrote it")
    if version != RECORD_VERSION:
        raise RecordError("version", f"{version}, expected {RECORD_VERSION}")
    if n != want.buffers:
        raise RecordError("count", f"{n} digests, expected {want.buffers} (one per buffer)")
    size = record_size(n)
    if size > len(raw):
        raise RecordError("length", f"a record of {n} digests needs {size} bytes, the slot "
                                    f"has {len(raw)}")
    end = size - DIGEST_BYTES
    got, calc = raw[end:size], _self_digest(raw[:end])
    if got != calc:
        raise RecordError("self_digest", f"{int.from_bytes(got, 'little'):#034x}, computed "
                                         f"{int.from_bytes(calc, 'little'):#034x} (a torn or "
                                         "stale record)")
    if tid != want.transfer_id & 0xFFFFFFFF:
        raise RecordError("transfer_id", f"{tid}, expected {want.transfer_id}")
    if slot != want.slot & 0xFFFFFFFF:
        raise RecordError("slot", f"{slot}, expected {want.slot}")
    expect_hash = request_hash(want.request_id)
    if rid_hash != expect_hash:
        raise RecordError("request_id", f"hash {rid_hash:#018x}, expected {expect_hash:#018x} "
                                        f"(request {want.request_id})")
    return Record(raw[HEADER.size:end], marks)


@dataclass(frozen=True)
class Advert:
    """A mailbox as decode advertises it: ``slots`` slots of ``record_bytes`` at ``addr``."""

    addr: int
    record_bytes: int
    slots: int

    @property
    def length(self) -> int:
        """The mailbox's bytes."""
        return self.record_bytes * self.slots

    def slot_addr(self, slot: int) -> int:
        """Where slot ``slot`` starts (its bounds are the caller's check)."""
        return self.addr + slot * self.record_bytes

    def text(self) -> str:
        """The ``extra`` value: ``addr:record_bytes:slots``."""
        return f"{self.addr}:{self.record_bytes}:{self.slots}"


def parse_advert(text: str, buffers: int, regions: tuple[RemoteRegion, ...]) -> Advert:
    """Decode's advertised mailbox, checked (it is the peer's word): three numbers, a
    slot that holds a record of ``buffers`` digests, and the whole mailbox inside one of
    the endpoint's ``regions``.

    Raises:
        RecordError: naming what is wrong (field ``mailbox``).
    """
    parts = text.split(":")
    try:
        addr, size, slots = (int(p) for p in parts)
    except ValueError:
        raise RecordError("mailbox", f"{MAILBOX_KEY} is {text!r}, expected "
                                     "ADDR:RECORD_BYTES:SLOTS") from None
    need = record_size(buffers)
    if not need <= size <= MAX_RECORD_BYTES:
        raise RecordError("mailbox", f"record_bytes {size}: a record of this layout's "
                                     f"{buffers} buffers needs {need}")
    if not 1 <= slots <= MAX_SLOTS or addr <= 0:
        raise RecordError("mailbox", f"{slots} slots at {addr:#x}: expected 1..{MAX_SLOTS} "
                                     "slots at a positive address")
    advert = Advert(addr, size, slots)
    if not any(r.addr <= addr and addr + advert.length <= r.end for r in regions):
        raise RecordError("mailbox", f"{advert.length} bytes at {addr:#x} lie in none of the "
                                     f"{len(regions)} regions decode's endpoint lets us write")
    return advert


def mailbox_region(advert: Advert | None,
                   regions: tuple[RemoteRegion, ...]) -> RemoteRegion | None:
    """The endpoint region holding the mailbox (None without one)."""
    if advert is None:
        return None
    for r in regions:
        if r.addr <= advert.addr and advert.addr + advert.length <= r.end:
            return r
    return None


class RecordArea:
    """``slots`` record slots of ``record_bytes`` in one anonymous mapping of our own:
    decode's mailbox (registered REMOTE_WRITE) or prefill's staging (LOCAL).

    The mapping never moves and is zeroed; the owner keeps it alive while it is
    registered (the runtime deregisters it first, then :meth:`close`).
    """

    def __init__(self, slots: int, record_bytes: int) -> None:
        if slots <= 0 or record_bytes <= 0:
            raise ValueError(f"a record area needs slots and bytes (got {slots} x "
                             f"{record_bytes})")
        self.slots = slots
        self.record_bytes = record_bytes
        self._map = mmap.mmap(-1, slots * record_bytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array: Bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.array[:] = 0  # every page touched before registration pins it
        self.addr = int(self.array.ctypes.data)

    @classmethod
    def for_buffers(cls, slots: int, buffers: int) -> RecordArea:
        """An area whose slots hold records of ``buffers`` digests."""
        return cls(slots, record_bytes(buffers))

    @property
    def region(self) -> Region:
        """The memory, for the transport's ``register``."""
        return Region(self.addr, self.slots * self.record_bytes)

    def advert(self) -> Advert:
        """How decode advertises it."""
        return Advert(self.addr, self.record_bytes, self.slots)

    def slot_addr(self, slot: int) -> int:
        """Where slot ``slot`` starts."""
        self._check(slot)
        return self.addr + slot * self.record_bytes

    def put(self, slot: int, data: bytes) -> None:
        """Write ``data`` at the start of a slot (prefill's staging; tests)."""
        self._check(slot)
        if len(data) > self.record_bytes:
            raise ValueError(f"{len(data)} bytes do not fit a {self.record_bytes}-byte slot")
        start = slot * self.record_bytes
        self.array[start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def read(self, slot: int) -> bytes:
        """A copy of a slot (decode, once the marker came: nothing writes it meanwhile)."""
        self._check(slot)
        start = slot * self.record_bytes
        return self.array[start:start + self.record_bytes].tobytes()

    def clear(self, slot: int) -> None:
        """Zero a slot's header (decode, when the slot is reserved): a stale record of
        an earlier request can never pass (its magic is gone)."""
        self._check(slot)
        start = slot * self.record_bytes
        self.array[start:start + HEADER.size] = 0

    def has_record(self, slot: int) -> bool:
        """Whether a slot starts with the record magic (written since it was cleared)."""
        self._check(slot)
        start = slot * self.record_bytes
        return self.array[start:start + 4].tobytes() == b"KVDR"

    def marks(self, slot: int) -> int:
        """The marks count of the record in a slot, unchecked (what decode waits for;
        the record's checks come with its verification, which refuses a wrong count)."""
        self._check(slot)
        return int(self.array[slot * self.record_bytes + MARKS_OFFSET])

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"record slot {slot} outside 0..{self.slots - 1}")

    def close(self) -> None:
        """Unmap (after the registration was released)."""
        self.array = np.zeros(0, dtype=np.uint8)
        self._map.close()


class FreeSlots:
    """Prefill's staging slots: which are free (lowest first). Not thread-safe: the
    prefill core's lock guards it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = list(range(size - 1, -1, -1))
        self._held: set[int] = set()

    def take(self) -> int | None:
        """A free slot, or None when every one is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def give(self, slot: int) -> None:
        """Free a held slot (a slot freed twice is a bug: refused)."""
        if slot not in self._held:
            raise ValueError(f"staging slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    @property
    def held(self) -> int:
        """Slots held."""
        return len(self._held)
