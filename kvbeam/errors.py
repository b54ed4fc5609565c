"""The kvbeam error hierarchy: every error kvbeam raises on purpose derives from
:class:`KvbeamError`, so callers can catch one type and users can search the
message text in the README's troubleshooting section."""

from __future__ import annotations

from dataclasses import dataclass


class KvbeamError(Exception):
    """Base class of every error kvbeam raises on purpose."""


class ConfigError(KvbeamError, ValueError):
    """A pool spec or daemon config that cannot be built; the message names the field."""


class PoolCompatibilityError(KvbeamError):
    """Target and draft pools of one side, or the pools of prefill and decode, differ.

    ``differences`` lists every difference found, not only the first.
    """

    def __init__(self, message: str, differences: list[Difference] | None = None) -> None:
        super().__init__(message)
        self.differences: list[Difference] = list(differences or [])


@dataclass(frozen=True)
class Difference:
    """One field on which two pool layouts differ.

    ``side`` says whose pools the field belongs to: ``prefill`` or ``decode`` for a
    target/draft difference within one side, ``prefill/decode`` for a difference
    across sides. ``values`` pairs each party with its value, e.g.
    ``(("target", "True"), ("draft", "False"))`` or ``(("prefill", "128"), ("decode", "256"))``.
    ``message`` is the full sentence (it starts with sglang's wording where one exists).
    """

    field: str
    side: str
    values: tuple[tuple[str, str], ...]
    message: str


class PlanError(KvbeamError, ValueError):
    """A transfer plan cannot be built: an index out of range, a length or item-length mismatch."""


class TransportError(KvbeamError):
    """A data-plane failure. ``status`` carries the verbs work-completion status where known."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


class RegionError(TransportError):
    """A block falls outside every registered local or remote region; nothing was posted."""
