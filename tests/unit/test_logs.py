"""Structured logs: request id and peer fields, text and JSON formats, the daemon options."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kvbeam.errors import ConfigError
from kvbeam.logs import (
    REQUEST_LOGGER,
    JsonFormatter,
    RoleFilter,
    TextFormatter,
    configure,
    fields,
    request_log,
)
from kvbeam.server.settings import resolve


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, logging.StreamHandler[io.StringIO]]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RoleFilter("decode"))
    logger = logging.getLogger("kvbeam.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, handler
    logger.removeHandler(handler)


def lines(handler: logging.StreamHandler[io.StringIO]) -> list[str]:
    return handler.stream.getvalue().splitlines()


def test_text_lines_end_with_request_and_peer(
        capture: tuple[logging.Logger, logging.StreamHandler[io.StringIO]]) -> None:
    logger, handler = capture
    handler.setFormatter(TextFormatter())
    logger.info("request %s: reserved slot %d", "r-1", 3, extra=fields("r-1", "10.0.0.2:7000"))
    logger.info("peer line", extra=fields(peer="10.0.0.2:7000"))
    logger.info("plain %d%%", 5)
    a, b, c = lines(handler)
    assert a.endswith("INFO kvbeam.test.logs: request r-1: reserved slot 3 request=r-1 "
                      "peer=10.0.0.2:7000")
    assert b.endswith("peer line peer=10.0.0.2:7000")
    assert c.endswith("plain 5%")


def test_json_lines_carry_every_field(
        capture: tuple[logging.Logger, logging.StreamHandler[io.StringIO]]) -> None:
    logger, handler = capture
    handler.setFormatter(JsonFormatter())
    logger.warning("request %s failed:\n%s", "r-2", "two lines", extra=fields("r-2", "h:1"))
    logger.info("no request here")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("request %s: unexpected error", "r-3", extra=fields("r-3", "h:1"))
    out = [json.loads(line) for line in lines(handler)]
    assert len(out) == 3  # one object per line, even for a multi-line message and a traceback
    first = out[0]
    assert set(first) == {"timestamp", "level", "logger", "message", "role", "request_id",
                          "peer"}
    assert first["level"] == "WARNING" and first["logger"] == "kvbeam.test.logs"
    assert first["message"] == "request r-2 failed:\ntwo lines"
    assert (first["role"], first["request_id"], first["peer"]) == ("decode", "r-2", "h:1")
    assert first["timestamp"].endswith("Z") and "T" in first["timestamp"]
    assert out[1]["request_id"] is None and out[1]["peer"] is None
    assert "RuntimeError: boom" in out[2]["exception"]


def test_configure_switches_the_root_handlers() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    stream = io.StringIO()
    root.handlers = [logging.StreamHandler(stream)]
    try:
        configure("INFO", "json", "prefill")
        configure("INFO", "json", "prefill")  # again: still one role filter
        assert len(root.handlers[0].filters) == 1
        logging.getLogger("kvbeam.x").info("hello", extra=fields("r", "p:1"))
        logging.getLogger("kvbeam.x").debug("not at INFO")
        rec = json.loads(stream.getvalue())
        assert (rec["message"], rec["role"], rec["request_id"]) == ("hello", "prefill", "r")
        configure("WARNING", "text", "prefill")
        assert isinstance(root.handlers[0].formatter, TextFormatter)
        assert root.level == logging.WARNING
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)


def test_request_progress_is_logged_only_when_asked() -> None:
    """``--log-requests``: kvbeam.requests logs at INFO with it or at DEBUG; without it
    only from WARNING on, while every other logger keeps the daemon's level."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_requests = request_log.level
    stream = io.StringIO()
    root.handlers = [logging.StreamHandler(stream)]
    try:
        configure("INFO", "text", "decode")
        request_log.info("request r-1: Success (quiet)")
        logging.getLogger("kvbeam.x").info("request r-1 aborted (always)")
        request_log.warning("request r-1: odd (always)")
        configure("INFO", "text", "decode", log_requests=True)
        request_log.info("request r-2: Success (asked)")
        configure("DEBUG", "text", "decode")
        request_log.info("request r-3: Success (debug)")
        configure("WARNING", "text", "decode", log_requests=True)
        request_log.info("request r-4: Success (asked at WARNING)")
        lines = stream.getvalue()
        assert "quiet" not in lines
        for word in ("aborted (always)", "odd (always)", "(asked)", "(debug)",
                     "(asked at WARNING)"):
            assert word in lines, lines
        assert f" {REQUEST_LOGGER}: request r-2" in lines
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)
        request_log.setLevel(saved_requests)


def test_daemon_options_metrics_and_log_format() -> None:
    s = resolve("decode", environ={"KVBEAM_CONFIG": "d.yaml"})
    assert (s.metrics, s.log_format, s.log_requests) == ("", "text", False)  # off by default
    s = resolve("decode", environ={"KVBEAM_CONFIG": "d.yaml", "KVBEAM_LOG_REQUESTS": "true"})
    assert s.log_requests
    s = resolve("decode", environ={"KVBEAM_CONFIG": "d.yaml", "KVBEAM_METRICS": "0.0.0.0:0",
                                   "KVBEAM_LOG_FORMAT": "json"})
    assert (s.metrics, s.log_format) == ("0.0.0.0:0", "json")
    with pytest.raises(ConfigError, match="--metrics: expected HOST:PORT"):
        resolve("decode", environ={"KVBEAM_CONFIG": "d.yaml", "KVBEAM_METRICS": "9100"})
    with pytest.raises(ConfigError, match="KVBEAM_LOG_FORMAT: 'xml' is not one of text, json"):
        resolve("decode", environ={"KVBEAM_CONFIG": "d.yaml", "KVBEAM_LOG_FORMAT": "xml"})
