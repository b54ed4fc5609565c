"""Test-only fault injection, switched on by environment variables, never by a flag.

Integrity checking is only worth its cost if it catches corruption every time, and
that needs corruption to happen on demand. ``KVBEAM_FAULT_CORRUPT_LANDED=P`` (a
fraction 0..1) makes decode flip one byte of a request's landed items, after the
completion arrived and before the digests are recomputed, in about that fraction of
requests. Each injection logs ``FAULT INJECTED: corrupted ...`` so tests can count
them against the integrity failures. ``KVBEAM_FAULT_SEED`` makes the choice
reproducible. Nothing here runs unless a variable is set, and a daemon with a fault
armed says so loudly at start-up.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvbeam.errors import ConfigError
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.plan import IndexLists
from kvbeam.server.logs import fields

log = logging.getLogger(__name__)

CORRUPT_LANDED_ENV = "KVBEAM_FAULT_CORRUPT_LANDED"
SEED_ENV = "KVBEAM_FAULT_SEED"


@dataclass
class FaultHooks:
    """The armed faults of one daemon (all off by default)."""

    corrupt_landed: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultHooks:
        """Read the fault variables; refuse values that are not what they should be."""
        env = os.environ if environ is None else environ
        corrupt = 0.0
        raw = env.get(CORRUPT_LANDED_ENV)
        if raw is not None:
            try:
                corrupt = float(raw)
            except ValueError as exc:
                raise ConfigError(f"{CORRUPT_LANDED_ENV}: not a number: {raw!r}") from exc
            if not 0.0 <= corrupt <= 1.0:
                raise ConfigError(f"{CORRUPT_LANDED_ENV}: must be in 0..1 (got {raw})")
        seed = 0
        if SEED_ENV in env:
            try:
                seed = int(env[SEED_ENV])
            except ValueError as exc:
                raise ConfigError(f"{SEED_ENV}: not an integer: {env[SEED_ENV]!r}") from exc
        hooks = cls(corrupt_landed=corrupt, seed=seed)
        if hooks.armed:
            log.warning("FAULT INJECTION ARMED (%s=%s): this daemon corrupts landed bytes on "
                        "purpose; never run it in production", CORRUPT_LANDED_ENV, corrupt)
        return hooks

    @property
    def armed(self) -> bool:
        """True when any fault is switched on."""
        return self.corrupt_landed > 0.0

    def after_landing(self, request_id: str, side: AllocatedSide, indices: IndexLists) -> None:
        """Maybe flip one byte of one item this request moved (decode, before verifying)."""
        if self.corrupt_landed <= 0.0:
            return
        with self._lock:
            if self._rng.random() >= self.corrupt_landed:
                return
            candidates = [buf for comp in side.layout.components for buf in comp.buffers
                          if len(indices[buf.index_kind])]
            if not candidates:
                return
            buf = self._rng.choice(candidates)
            item = int(self._rng.choice(indices[buf.index_kind].tolist()))
            offset = self._rng.randrange(buf.item_len)
        items = side.buffer_view(buf).numpy().reshape(buf.items, buf.item_len)
        items[item, offset] = np.uint8(items[item, offset] ^ 0xFF)
        log.warning("FAULT INJECTED: corrupted request %s buffer %s item %d byte %d",
                    request_id, buf.name, item, offset, extra=fields(request_id))
