"""The engine integrations' credentials: sglang's settings and the clients built with them,
the sglang bootstrap store's token (issue 22, item 6), and the vLLM connector's refusal of
credential keys (over the engine channel it makes no gRPC call: issue 23). No vLLM
import; sglang's base classes are imported by the sglang tests."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbeam.auth import CLIENT_SETTINGS
from kvbeam.errors import AuthenticationError, ConfigError
from kvbeam.integrations.sglang import bootstrap
from kvbeam.integrations.vllm import params as P

BASE = {"daemon": "127.0.0.1:7", "attach_socket": "/x.sock"}


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text("engine-token\n")
    return str(path)


# ---- vLLM: no credentials (the connector makes no gRPC call) ---------------------------
@pytest.mark.parametrize("key", CLIENT_SETTINGS)
def test_vllm_settings_refuse_credential_keys_pointing_at_the_daemons(key: str,
                                                                     token_file: str) -> None:
    """The connector's every call goes over its attach socket (the daemon checks the
    engine's uid): a credential in ``kv_connector_extra_config`` would protect nothing, so
    it is refused at vLLM's start-up, saying where the credentials go instead."""
    with pytest.raises(ConfigError) as info:
        P.Settings.from_extra({**BASE, key: token_file}, "m")
    message = str(info.value)
    assert message.startswith(f"kv_connector_extra_config: {key}: the connector makes no "
                              "gRPC call"), message
    assert "attach socket" in message and "--attach-allow-uid" in message, message
    assert "--auth-token-file" in message and "--tls-cert" in message, message
    assert "engine-token" not in message


def test_vllm_settings_hold_no_credentials() -> None:
    assert "security" not in {f.name for f in fields(P.Settings)}
    with pytest.raises(ConfigError, match=r"unknown key\(s\) auth_token"):
        P.Settings.from_extra({**BASE, "auth_token": "inline"}, "m")  # no inline secret either


def test_the_vllm_connector_imports_no_grpc() -> None:
    """The scheduler and worker sides, settings read: gRPC is never imported in vLLM's
    processes (kvbeam.auth, whose credential keys they read, imports none)."""
    code = ("import sys\n"
            "from kvbeam.integrations.vllm import params, scheduler, worker\n"
            f"params.Settings.from_extra({BASE!r}, 'm')\n"
            "print(sorted(m for m in ('grpc', 'kvbeam.auth_grpc', 'kvbeam.client') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- sglang: settings and the bootstrap store ----------------------------------------------
def test_sglang_credentials_from_server_args_else_the_environment(
        monkeypatch: pytest.MonkeyPatch, token_file: str, tmp_path: Path) -> None:
    from kvbeam.integrations.sglang.conn import credentials

    for var in ("KVBEAM_AUTH_TOKEN_FILE", "KVBEAM_TLS_CERT", "KVBEAM_TLS_KEY", "KVBEAM_TLS_CA",
                "KVBEAM_TLS_SERVER_NAME"):
        monkeypatch.delenv(var, raising=False)
    assert credentials(SimpleNamespace()).mode == "none"
    assert credentials(SimpleNamespace(kvbeam_auth_token_file=token_file)).token == "engine-token"
    other = tmp_path / "other"
    other.write_text("env-token")
    monkeypatch.setenv("KVBEAM_AUTH_TOKEN_FILE", str(other))
    assert credentials(None).token == "env-token"  # the bootstrap server has no server_args
    assert credentials(SimpleNamespace(kvbeam_auth_token_file=token_file)).token == "engine-token"
    monkeypatch.setenv("KVBEAM_TLS_CERT", "c.pem")
    with pytest.raises(ConfigError, match=r"^kvbeam sglang backend: mTLS needs"):
        credentials(None)


def test_bootstrap_store_requires_its_token() -> None:
    server = bootstrap.BootstrapServer("127.0.0.1", 0, token="store-token")
    try:
        bootstrap.call(server.address, "put", "room.1", {"daemon": "d:1"}, token="store-token")
        assert bootstrap.call(server.address, "get", "room.1", token="store-token") == {
            "daemon": "d:1"}
        for wrong, why in (("", "no token"), ("nope", "a wrong token")):
            with pytest.raises(AuthenticationError) as info:
                bootstrap.call(server.address, "put", "room.1", {"daemon": "rogue:1"},
                               token=wrong)
            assert f"refused: {why}" in str(info.value)
            assert "KVBEAM_AUTH_TOKEN_FILE" in str(info.value)
        # Nothing a refused caller sent was stored.
        assert bootstrap.call(server.address, "get", "room.1", token="store-token") == {
            "daemon": "d:1"}
    finally:
        server.close()


def test_bootstrap_store_off_loopback_needs_a_token_or_insecure() -> None:
    with pytest.raises(ConfigError, match=r"refusing to serve the kvbeam bootstrap store on "
                                          r"0\.0\.0\.0 without a token"):
        bootstrap.BootstrapServer("0.0.0.0", 0)
    bootstrap.BootstrapServer("0.0.0.0", 0, token="t").close()
    bootstrap.BootstrapServer("0.0.0.0", 0, insecure=True).close()
