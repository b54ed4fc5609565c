"""``--pools``, ``--attach-socket``, ``--attach-allow-uid`` and ``--attach-group``: flags,
variables, defaults."""

from __future__ import annotations

import pytest

from kvbeam.errors import ConfigError
from kvbeam.server.engines.attach import default_socket_path
from kvbeam.server.settings import resolve
from tests.control_helpers import daemon_args


def test_pools_own_is_the_default_and_needs_a_config() -> None:
    assert resolve("decode", daemon_args("--config", "x.yaml"), environ={}).pools == "own"
    with pytest.raises(ConfigError, match=r"--config .* is required"):
        resolve("decode", daemon_args(), environ={})


def test_pools_engine_needs_no_config_and_takes_repeated_uids() -> None:
    s = resolve("decode", daemon_args("--pools", "engine", "--attach-allow-uid", "1000",
                                      "--attach-allow-uid", "1001,1002"), environ={})
    assert (s.pools, s.config, s.attach_allow_uid) == ("engine", "", (1000, 1001, 1002))
    env = {"KVBEAM_POOLS": "engine", "KVBEAM_ATTACH_ALLOW_UID": "7", "KVBEAM_ATTACH_SOCKET": "/s"}
    s = resolve("prefill", daemon_args(), environ=env)
    assert (s.pools, s.attach_allow_uid, s.attach_socket) == ("engine", (7,), "/s")
    with pytest.raises(ConfigError, match="KVBEAM_ATTACH_ALLOW_UID: not a uid: 'x'"):
        resolve("prefill", daemon_args(), environ={**env, "KVBEAM_ATTACH_ALLOW_UID": "x"})


def test_attach_group_is_empty_by_default_and_taken_from_flag_or_variable() -> None:
    assert resolve("decode", daemon_args("--pools", "engine"), environ={}).attach_group == ""
    s = resolve("decode", daemon_args("--pools", "engine", "--attach-group", "kvbeam"),
                environ={"KVBEAM_ATTACH_GROUP": "other"})
    assert s.attach_group == "kvbeam"
    s = resolve("decode", daemon_args("--pools", "engine"), environ={"KVBEAM_ATTACH_GROUP": "7"})
    assert s.attach_group == "7"


def test_default_socket_path_names_role_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/5")
    assert default_socket_path("decode", "0.0.0.0:50052") == "/run/user/5/kvbeam/decode-50052.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path("prefill", "127.0.0.1:0").endswith("/prefill.sock")
