"""``--digest-threads``: flag, variable, default, refusal, and the pool the servicer builds."""

from __future__ import annotations

import argparse
import os

import pytest

from kvbeam.errors import ConfigError
from kvbeam.server.settings import DEFAULT_DIGEST_THREADS, add_daemon_arguments, resolve
from tests.control_helpers import daemon_args


def test_the_default_is_one_thread_per_core_at_most_four() -> None:
    s = resolve("decode", daemon_args("--config", "x.yaml"), environ={})
    assert s.digest_threads == DEFAULT_DIGEST_THREADS == min(4, os.cpu_count() or 1)


def test_the_flag_wins_over_the_variable_and_zero_is_allowed() -> None:
    env = {"KVBEAM_DIGEST_THREADS": "3"}
    assert resolve("prefill", daemon_args("--config", "x.yaml"), environ=env).digest_threads == 3
    assert resolve("prefill", daemon_args("--config", "x.yaml", "--digest-threads", "0"),
                   environ=env).digest_threads == 0


def test_a_negative_count_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--digest-threads: must be 0 or more \(got -2\)"):
        resolve("decode", daemon_args("--config", "x.yaml", "--digest-threads", "-2"),
                environ={})


def test_help_shows_the_flag_and_its_variable() -> None:
    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--digest-threads" in text and "KVBEAM_DIGEST_THREADS" in text
    assert "one per core, at most 4" in text
