"""Checks of request fields shared by the RPC handlers; each refusal says what and why."""

from __future__ import annotations

import re

from kvbeam.errors import BadRequest

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")


def request_id_of(value: str) -> str:
    """A request id: 1-128 characters of ``[A-Za-z0-9._:/@+=-]``."""
    if not _REQUEST_ID.fullmatch(value):
        raise BadRequest(f"request_id must be 1-128 characters of [A-Za-z0-9._:/@+=-] "
                         f"(got {value[:64]!r})")
    return value


def seq_len_of(value: int, max_context_len: int) -> int:
    """A sequence length in 1..max_context_len."""
    if not 0 < value <= max_context_len:
        raise BadRequest(f"seq_len must be in 1..{max_context_len} (max_context_len of this "
                         f"pool), got {value}")
    return value
