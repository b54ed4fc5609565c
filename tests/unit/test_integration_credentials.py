"""The engine integrations' credentials: settings parsing, every client built with them, the
sglang bootstrap store's token (issue 22, item 6). No vLLM import (fakes); sglang's base
classes are imported by the sglang tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvbeam.auth import Security
from kvbeam.errors import AuthenticationError, ConfigError
from kvbeam.integrations.sglang import bootstrap
from kvbeam.integrations.vllm import params as P
from kvbeam.integrations.vllm import scheduler as S
from kvbeam.integrations.vllm import worker as W
from tests.tls_helpers import Pki

BASE = {"daemon": "127.0.0.1:7", "attach_socket": "/x.sock"}


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text("engine-token\n")
    return str(path)


# ---- vLLM: kv_connector_extra_config ---------------------------------------------------
def test_vllm_settings_read_the_token_file_and_tls_files(token_file: str, pki: Pki) -> None:
    s = P.Settings.from_extra({**BASE, "auth_token_file": token_file}, "m")
    assert s.security.token == "engine-token" and not s.security.tls
    cert, key = pki.issue("vllm")
    s = P.Settings.from_extra({**BASE, "tls_cert": str(cert), "tls_key": str(key),
                               "tls_ca": str(pki.ca), "tls_server_name": "kvbeam",
                               "auth_token_file": token_file}, "m")
    assert s.security.mode == "mtls+token" and s.security.tls_server_name == "kvbeam"
    assert P.Settings.from_extra(BASE, "m").security.mode == "none"
    assert "engine-token" not in repr(s)


@pytest.mark.parametrize(("extra", "needle"), [
    ({"auth_token_file": "/nonexistent/token"},
     "kv_connector_extra_config: --auth-token-file: cannot read /nonexistent/token"),
    ({"tls_cert": "c.pem"}, "kv_connector_extra_config: mTLS needs --tls-cert, --tls-key and "
                            "--tls-ca together; missing --tls-key, --tls-ca"),
    ({"tls_ca": 3}, "kv_connector_extra_config.tls_ca: a string is needed"),
    ({"auth_token": "inline"}, "unknown key(s) auth_token"),  # a file only: no secret in config
])
def test_vllm_settings_refuse_bad_credentials_naming_the_key(extra: dict[str, Any],
                                                             needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        P.Settings.from_extra({**BASE, **extra}, "m")
    assert needle in str(info.value)


def test_vllm_scheduler_side_presents_the_credentials(monkeypatch: pytest.MonkeyPatch,
                                                       token_file: str) -> None:
    settings = P.Settings.from_extra({**BASE, "auth_token_file": token_file}, "m")
    made: list[tuple[str, Security | None]] = []

    class Fake:
        def __init__(self, daemon: str, rid: str, peer: str, *,
                     security: Security | None = None) -> None:
            made.append((daemon, security))

        def send(self, ids: list[int], *, seq_len: int) -> None:
            pass

        reserve = send

    monkeypatch.setattr(S, "Sender", Fake)
    monkeypatch.setattr(S, "Receiver", Fake)
    side = S.SchedulerSide(settings, block_size=32)
    prefill_req = SimpleNamespace(request_id="a", prompt_token_ids=list(range(40)),
                                  status="FINISHED_LENGTH_CAPPED",
                                  kv_transfer_params={"do_remote_decode": True,
                                                      "kvbeam_id": "t1", "decode_daemon": "d:1"})
    side.request_finished(prefill_req, [5, 9])
    decode_req = SimpleNamespace(request_id="b", prompt_token_ids=list(range(40)),
                                 kv_transfer_params=P.returned_params("t2", "p:1", 40))
    side.update_state_after_alloc(decode_req, SimpleNamespace(get_block_ids=lambda: ([1, 2],)),
                                  40)
    assert made == [("127.0.0.1:7", settings.security)] * 2


def test_vllm_worker_side_presents_the_credentials(monkeypatch: pytest.MonkeyPatch,
                                                    token_file: str) -> None:
    settings = P.Settings.from_extra({**BASE, "auth_token_file": token_file}, "m")
    built: list[tuple[str, Security | None]] = []

    class Client:
        def status(self, rid: str) -> Any:
            from kvbeam.states import TransferState

            return SimpleNamespace(state=TransferState.SUCCESS)

        def release(self, rid: str) -> None:
            pass

    def client_for(address: str, security: Security | None = None) -> Client:
        built.append((address, security))
        return Client()

    monkeypatch.setattr(W, "client_for", client_for)
    worker = W.WorkerSide(settings, block_size=32, num_kv_heads=1, head_size=8)
    worker.absorb(S.StepPlan(loads=[S.Load("r", "t", (1,))], sends=[("s", "u")]))
    assert worker.get_finished() == ({"s"}, {"r"})  # polls both, releases the load
    assert built and all(b == ("127.0.0.1:7", settings.security) for b in built)
    assert len(built) == 3  # two polls and the release


def test_shared_clients_are_per_address_and_credentials() -> None:
    from kvbeam.engine.requests import client_for

    a = client_for("127.0.0.1:9", Security(token="a"))
    assert client_for("127.0.0.1:9", Security(token="a")) is a
    b = client_for("127.0.0.1:9", Security(token="b"))
    assert b is not a and b.security.token == "b"
    assert client_for("127.0.0.1:9").security.mode == "none"


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
