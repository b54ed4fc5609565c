"""Structured daemon logs: request id and peer as fields, text or one JSON object per line.

A log call about a request passes its request id and peer as fields::

    log.info("request %s: reserved slot %d", rid, slot, extra=fields(rid, peer))

The message stays readable on its own; the fields make every line about a request
findable by exact match (``request=ID peer=HOST:PORT`` at the end of a text line,
``"request_id"``/``"peer"`` keys in JSON), whatever the message says.
:func:`configure` installs the format the daemon was asked for (``--log-format``).

Every transfer that ends gets one line on :data:`end_log` (logger ``kvbeam.transfers``,
INFO, on by default): Success or Failed with its cause, bytes, milliseconds and how it
was verified, at most ``--log-ends-per-s`` lines a second (kvbeam.server.end_log).

A request's progress when all goes well (decode reserved it, prefill posted it, Success
on each side, the slot freed) goes to :data:`request_log` (logger ``kvbeam.requests``),
which logs at INFO only with ``--log-requests`` (or ``--log-level DEBUG``): a line per
step per request costs each daemon about a tenth of a millisecond of CPU per small
request at INFO (docs/performance.md), so, as vLLM's ``--enable-log-requests`` and
sglang's ``--log-requests``, it is off by default. Failures, refusals and anything
unusual about a request are logged on the module's own logger, always.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

#: Attribute names the fields travel under on a ``logging.LogRecord``.
REQUEST_ID = "request_id"
PEER = "peer"
ROLE = "role"

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The logger of a request's progress when all goes well (see the module docstring).
REQUEST_LOGGER = "kvbeam.requests"
#: Where a daemon logs a request's progress: reserved, posted, Success, slot freed.
request_log = logging.getLogger(REQUEST_LOGGER)
#: The logger of the one line per ended transfer (kvbeam.server.end_log; on by default,
#: rate-limited by ``--log-ends-per-s``).
END_LOGGER = "kvbeam.transfers"
end_log = logging.getLogger(END_LOGGER)


def fields(request_id: str | None = None, peer: str | None = None) -> dict[str, str]:
    """The ``extra=`` of a log call about a request and/or a peer (HOST:PORT or instance)."""
    out: dict[str, str] = {}
    if request_id is not None:
        out[REQUEST_ID] = request_id
    if peer is not None:
        out[PEER] = peer
    return out


class RoleFilter(logging.Filter):
    """Stamps every record with the daemon's role (prefill or decode)."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the role; never drops a record."""
        if not hasattr(record, ROLE):
            setattr(record, ROLE, self.role)
        return True


class TextFormatter(logging.Formatter):
    """The usual text line, then ``request=ID peer=ADDR`` when the record carries them."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        """Format the line; the fields go before any traceback, on the message's line."""
        tags = " ".join(f"{key}={value}" for key, value in
                        (("request", getattr(record, REQUEST_ID, None)),
                         ("peer", getattr(record, PEER, None))) if value is not None)
        if not tags:
            return super().format(record)
        saved = record.msg, record.args
        record.msg, record.args = f"{record.getMessage()} {tags}", None
        try:
            return super().format(record)
        finally:
            record.msg, record.args = saved


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp (UTC, ISO 8601), level, logger, message, role,
    request_id, peer (null when the line is not about one), and exception (a traceback)
    when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        """Serialise the record; newlines in a message stay escaped inside its string."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "timestamp": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "role": getattr(record, ROLE, None),
            "request_id": getattr(record, REQUEST_ID, None),
            "peer": getattr(record, PEER, None),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str, fmt: str, role: str, *, log_requests: bool = False) -> None:
    """Send the root logger's records to stderr in ``fmt`` ("text" or "json") at ``level``;
    :data:`request_log`'s at INFO with ``log_requests`` or at DEBUG, else none below
    WARNING (``--log-requests``).

    Replaces the formatter (and role filter) of the root's handlers, adding a
    stderr handler if there is none, so lines logged before and after look alike.
    """
    root = logging.getLogger()
    root.setLevel(level)
    request_log.setLevel(logging.INFO if log_requests or level == "DEBUG"
                         else logging.WARNING)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    formatter: logging.Formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    for handler in root.handlers:
        handler.setFormatter(formatter)
        for old in [f for f in handler.filters if isinstance(f, RoleFilter)]:
            handler.removeFilter(old)
        handler.addFilter(RoleFilter(role))
