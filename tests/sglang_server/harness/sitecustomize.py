"""The served test's negative control, inside the decode server (test harness only).

tests/host/test_sglang_server.py starts the decode server with this folder on its
PYTHONPATH and ``KVBEAM_TEST_ARM_FILE`` naming a file in the test's own folder. Python
imports this module at start in every process of that server; it wraps kvbeam's
receiver there (through the plugin entry point, so the scheduler process gets it too).
When the test writes ``block`` or ``row`` into the arm file, the next request whose
transfer kvbeam reports Success, before sglang's scheduler reads any of it, gets:

- ``block``: its first moved page overwritten with random bytes in every K and V buffer;
- ``row``: its metadata row's bootstrap room changed (sglang checks it).

A staged decode server (tests/host/test_sglang_staged.py) also takes ``staged``: the
next request's first page overwritten with random bytes in its staging items (every K
and V buffer), after the landing and before kvbeam scatters them into sglang's pool.

The arm file is consumed (emptied) by that request. Nothing here is kvbeam's code: the
package has no switch for it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random

log = logging.getLogger("kvbeam.test.harness")
ARM_FILE = os.environ.get("KVBEAM_TEST_ARM_FILE", "")


def _armed(only: str = "") -> str:
    """The armed mode, consumed ("" : none; with ``only``, that mode only)."""
    try:
        with open(ARM_FILE, "r+") as f:
            mode = f.read().strip()
            if only and mode != only:
                return ""
            f.seek(0)
            f.truncate()
    except OSError:
        return ""
    return mode


def _corrupt(rx: object, mode: str) -> None:
    kv_args = rx.mgr.kv_args  # type: ignore[attr-defined]
    if mode == "block":
        page = int(rx._harness_pages[0])  # type: ignore[attr-defined]
        rng = random.Random(page)
        for ptr, item in zip(kv_args.kv_data_ptrs, kv_args.kv_item_lens, strict=True):
            junk = bytes(rng.randrange(256) for _ in range(item))
            ctypes.memmove(ptr + page * item, junk, item)
    elif mode == "row":
        row = int(rx._harness_aux)  # type: ignore[attr-defined]
        ptr, item = kv_args.aux_data_ptrs[-1], kv_args.aux_item_lens[-1]  # bootstrap_room
        room = ctypes.c_uint64.from_address(ptr + row * item)
        room.value = room.value + 1
    log.warning("HARNESS: corrupted the moved %s of room %s", mode, rx.room)  # type: ignore[attr-defined]
    print(f"HARNESS: corrupted the moved {mode} of room {rx.room}", flush=True)  # type: ignore[attr-defined]


def _corrupt_staged(rx: object) -> None:
    from kvbeam.pools.types import IndexKind

    staging = rx.mgr.staging  # type: ignore[attr-defined]
    item = int(rx.staged.staged.lists[IndexKind.KV_PAGES][0])  # type: ignore[attr-defined]
    rng = random.Random(item)
    for buf in staging.layout.flat_buffers:
        if buf.index_kind is IndexKind.KV_PAGES:
            row = staging.pools.buffer_array(buf).reshape(-1, buf.item_len)[item]
            row[:] = bytearray(rng.randrange(256) for _ in range(buf.item_len))
    log.warning("HARNESS: corrupted the staged block of room %s", rx.room)  # type: ignore[attr-defined]
    print(f"HARNESS: corrupted the staged block of room {rx.room}", flush=True)  # type: ignore[attr-defined]


def _patch_receiver() -> None:
    from kvbeam.integrations.sglang import conn

    cls = conn.KvbeamKVReceiver
    send_metadata, poll = cls.send_metadata, cls.poll
    before_scatter = cls._before_scatter

    def wrapped_send_metadata(self, kv_indices, aux_index=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._harness_pages, self._harness_aux = list(kv_indices), aux_index
        return send_metadata(self, kv_indices, aux_index, *args, **kwargs)

    def wrapped_poll(self):  # type: ignore[no-untyped-def]
        state = poll(self)
        if state == 4 and not getattr(self, "_harness_seen", False):
            self._harness_seen = True
            mode = _armed()
            if mode:
                _corrupt(self, mode)
        return state

    def wrapped_before_scatter(self):  # type: ignore[no-untyped-def]
        if _armed("staged"):
            _corrupt_staged(self)
        before_scatter(self)

    setattr(cls, "send_metadata", wrapped_send_metadata)  # noqa: B010 (a method, wrapped)
    setattr(cls, "poll", wrapped_poll)  # noqa: B010
    setattr(cls, "_before_scatter", wrapped_before_scatter)  # noqa: B010


if ARM_FILE:
    import kvbeam.integrations.sglang.plugin as _plugin

    _load = _plugin.load

    def _load_and_arm() -> None:
        _load()
        _patch_receiver()

    _plugin.load = _load_and_arm
