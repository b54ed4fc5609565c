"""Control-plane authentication on loopback: mTLS, shared token, the bind policy, settings, CLI.

A peer that fails authentication must get nothing: no SideInfo (addresses, QPNs,
rkeys), no rejection trailer (our layout), no registration as a peer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from kvbeam.auth import TOKEN_KEY, Security, is_loopback
from kvbeam.client import KvbeamClient
from kvbeam.errors import AuthenticationError, ConfigError, PeerUnavailableError
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.rejection_codec import REJECTION_KEY
from kvbeam.proto.service import control_stub
from kvbeam.proto.side import Role, SideInfo, side_to_proto
from kvbeam.scheduler import run_request
from kvbeam.server.api.control import ControlServer
from kvbeam.server.peers.client import ControlClient
from kvbeam.server.settings import ControlOptions, resolve
from kvbeam.server.settings import resolve_security as client_security
from tests.control_helpers import config, daemon_args, run_cli, side
from tests.tls_helpers import Pki

TOKEN = "s3cret-token-for-tests"


def sides() -> tuple[SideInfo, SideInfo]:
    """(prefill, decode) sides that verify against each other."""
    return side(Role.PREFILL, config()), side(Role.DECODE, config())


@contextmanager
def serving(local: SideInfo, security: Security,
            address: str = "127.0.0.1:0") -> Iterator[ControlServer]:
    server = ControlServer(local, options=ControlOptions(security=security, rpc_timeout_s=3.0),
                           startup_check=False)
    server.start(address)
    try:
        yield server
    finally:
        server.stop(grace=0)


def client(address: str, security: Security) -> ControlClient:
    return ControlClient(address, options=ControlOptions(security=security, rpc_timeout_s=3.0))


def raw_call(address: str, metadata: tuple[tuple[str, str], ...] | None,
             method: str = "Handshake") -> grpc.RpcError:
    """Call ``method`` over plaintext with ``metadata``; the error it must raise."""
    prefill, _ = sides()
    with grpc.insecure_channel(address) as channel:
        stub = control_stub(channel)
        try:
            if method == "Handshake":
                stub.Handshake(pb.HandshakeRequest(side=side_to_proto(prefill)), timeout=3,
                               metadata=metadata)
            elif method == "WatchStatus":
                list(stub.WatchStatus(pb.StatusRequest(request_id="r"), timeout=3,
                                      metadata=metadata))
            else:
                stub.Heartbeat(pb.HeartbeatRequest(instance_id="x"), timeout=3,
                               metadata=metadata)
        except grpc.RpcError as exc:
            return exc
    raise AssertionError(f"{method} succeeded without valid credentials")


# ---- shared token ----------------------------------------------------------------------


def test_token_handshake_succeeds_with_the_token() -> None:
    prefill, decode = sides()
    with serving(decode, Security(token=TOKEN)) as server, \
            client(server.address, Security(token=TOKEN)) as c:
        peer = c.handshake(prefill)
        assert peer.instance_id == decode.instance_id
        assert len(server.peers) == 1


@pytest.mark.parametrize("presented", [None, "wrong", TOKEN[:-1], TOKEN + "x",
                                       f"bearer {TOKEN}", TOKEN])
@pytest.mark.parametrize("method", ["Handshake", "Heartbeat", "WatchStatus"])
def test_missing_or_wrong_token_is_unauthenticated_and_leaks_nothing(
        presented: str | None, method: str) -> None:
    _, decode = sides()
    # A bare token (no "Bearer ") and a lower-case scheme are wrong too.
    metadata = None if presented is None else (
        (TOKEN_KEY, presented if presented.startswith("bearer") or presented == TOKEN
         else f"Bearer {presented}"),)
    with serving(decode, Security(token=TOKEN)) as server:
        exc = raw_call(server.address, metadata, method)
        assert exc.code() is grpc.StatusCode.UNAUTHENTICATED, exc
        assert "auth token" in (exc.details() or "")
        trailers = {m.key: m.value for m in exc.trailing_metadata() or ()}
        assert REJECTION_KEY not in trailers  # not even our layout in a rejection
        assert decode.instance_id not in str(trailers) + (exc.details() or "")
        assert len(server.peers) == 0


def test_client_with_the_wrong_token_gets_an_authentication_error(
        caplog: pytest.LogCaptureFixture) -> None:
    prefill, decode = sides()
    with serving(decode, Security(token=TOKEN)) as server, \
            client(server.address, Security(token="nope")) as c:
        with pytest.raises(AuthenticationError, match="refused our credentials") as info:
            c.handshake(prefill)
        assert info.value.code == "UNAUTHENTICATED"
        assert len(server.peers) == 0
    assert any("refused: a wrong auth token" in r.getMessage() for r in caplog.records)


def test_health_is_exempt_from_the_token() -> None:
    _, decode = sides()
    with serving(decode, Security(token=TOKEN)) as server:
        with KvbeamClient(server.address) as anonymous:
            assert anonymous.healthy()
        with KvbeamClient(server.address, security=Security(token=TOKEN)) as c:
            assert c.healthy()


# ---- mTLS ----------------------------------------------------------------------------


def test_health_command_dials_mtls_with_the_tls_flags(pki: Pki) -> None:
    """``kvbeam health`` (the exec probe) answers SERVING through mTLS only with the flags."""
    _, decode = sides()
    cert, key = pki.issue("probe")
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(pki.ca)]
    # The Kubernetes mTLS probe passes them as the pod's KVBEAM_TLS_* variables.
    tls_env = {**os.environ, "KVBEAM_TLS_CERT": str(cert), "KVBEAM_TLS_KEY": str(key),
               "KVBEAM_TLS_CA": str(pki.ca)}
    with serving(decode, pki.security("decode")) as server:
        probe = [sys.executable, "-m", "kvbeam.commands.health", server.address]
        for extra, environ in ((tls, None), ([], tls_env)):
            ok = subprocess.run([*probe, *extra], capture_output=True, text=True, timeout=60,
                                env=environ)
            assert ok.returncode == 0, ok.stderr
            assert "SERVING" in ok.stdout
        plain = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert plain.returncode == 1 and "not serving" in plain.stderr
    bad = subprocess.run([*probe, "--tls-cert", str(cert)], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--tls-key" in bad.stderr, bad.stderr



def test_mtls_handshake_with_certificates_from_the_ca(pki: Pki) -> None:
    prefill, decode = sides()
    with serving(decode, pki.security("decode")) as server:
        with client(server.address, pki.security("prefill")) as c:
            assert c.handshake(prefill).instance_id == decode.instance_id
        port = server.port  # the certificate names localhost too
        with client(f"localhost:{port}", pki.security("prefill2")) as c:
            c.handshake(prefill)
        assert len(server.peers) == 1  # one prefill instance, handshook twice


def _assert_tls_refuses(address: str, creds: grpc.ChannelCredentials, side: SideInfo) -> None:
    """A raw gRPC Handshake over TLS with ``creds`` dies in the TLS handshake (UNAVAILABLE)."""
    with grpc.secure_channel(address, creds) as channel, pytest.raises(grpc.RpcError) as info:
        control_stub(channel).Handshake(pb.HandshakeRequest(side=side_to_proto(side)),
                                        timeout=3)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_peer_without_a_certificate(pki: Pki) -> None:
    prefill, decode = sides()
    with serving(decode, pki.security("decode")) as server:
        with client(server.address, Security()) as c, \
                pytest.raises(PeerUnavailableError, match="requires mTLS"):  # plaintext
            c.handshake(prefill)
        # TLS that trusts our CA, but presents no client certificate.
        creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        _assert_tls_refuses(server.address, creds, prefill)
        assert len(server.peers) == 0


def test_mtls_refuses_a_certificate_from_another_ca(pki: Pki, rogue_pki: Pki) -> None:
    prefill, decode = sides()
    with serving(decode, pki.security("decode")) as server:
        with client(server.address, rogue_pki.security("prefill")) as c, \
                pytest.raises(AuthenticationError, match="TLS handshake failed"):
            c.handshake(prefill)
        # A rogue client certificate, but trusting the server: the server refuses it.
        cert, key = rogue_pki.issue("intruder")
        creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), key.read_bytes(),
                                             cert.read_bytes())
        _assert_tls_refuses(server.address, creds, prefill)
        assert len(server.peers) == 0


def test_mtls_and_token_together_need_both(pki: Pki) -> None:
    prefill, decode = sides()
    both = dataclasses.replace(pki.security("decode"), token=TOKEN)
    with serving(decode, both) as server:
        with client(server.address, pki.security("p1")) as c, \
                pytest.raises(AuthenticationError, match="UNAUTHENTICATED"):
            c.handshake(prefill)
        with client(server.address, dataclasses.replace(pki.security("p2"), token=TOKEN)) as c:
            c.handshake(prefill)


def test_server_name_override(pki: Pki) -> None:
    """Dialling an address the certificate does not name works with --tls-server-name."""
    prefill, decode = sides()
    with serving(decode, pki.security("decode"), "0.0.0.0:0") as server:
        with client(f"127.0.0.2:{server.port}", pki.security("p")) as c, \
                pytest.raises(AuthenticationError):  # 127.0.0.2 is not in the certificate
            c.handshake(prefill)
        sec = pki.security("p", tls_server_name="localhost")
        with client(f"127.0.0.2:{server.port}", sec) as c:
            c.handshake(prefill)


# ---- the bind policy --------------------------------------------------------------------


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("[::]", False), ("", False), ("10.1.2.3", False),
    ("no-such-host.invalid", False)])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_non_loopback_without_auth_is_refused() -> None:
    _, decode = sides()
    with pytest.raises(ConfigError) as info, serving(decode, Security(), "0.0.0.0:0"):
        pass
    text = str(info.value)
    assert "refusing to listen on 0.0.0.0:0 without authentication" in text
    for flag in ("--tls-cert", "--auth-token", "--insecure"):
        assert flag in text


def test_insecure_allows_it_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    _, decode = sides()
    with caplog.at_level(logging.WARNING), serving(decode, Security(insecure=True), "0.0.0.0:0"):
        pass
    assert any("NO authentication (--insecure)" in r.getMessage() for r in caplog.records)


def test_authenticated_server_may_bind_any_address(caplog: pytest.LogCaptureFixture) -> None:
    _, decode = sides()
    with caplog.at_level(logging.WARNING), serving(decode, Security(token=TOKEN), "0.0.0.0:0"):
        pass
    assert not any("NO authentication" in r.getMessage() for r in caplog.records)


def test_loopback_without_auth_warns_at_start(caplog: pytest.LogCaptureFixture) -> None:
    _, decode = sides()
    with caplog.at_level(logging.WARNING), serving(decode, Security()):
        pass
    warned = [r for r in caplog.records if "has NO authentication" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING
    assert "loopback development only" in warned[0].getMessage()


# ---- settings ----------------------------------------------------------------------------


def _daemon(*argv: str, env: dict[str, str] | None = None) -> Security:
    return resolve("decode", daemon_args("--config", "c.yaml", *argv), env or {}).security


def test_settings_token_from_flag_env_and_file(tmp_path: Path) -> None:
    assert _daemon("--auth-token", "a").token == "a"
    assert _daemon(env={"KVBEAM_AUTH_TOKEN": "b"}).token == "b"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert _daemon("--auth-token-file", str(f)).token == "from-file"
    assert _daemon(env={"KVBEAM_AUTH_TOKEN_FILE": str(f)}).token == "from-file"
    s = _daemon("--auth-token", "hidden-value")
    assert "hidden-value" not in repr(s)


def test_settings_tls_from_env(pki: Pki) -> None:
    cert, key = pki.issue("env")
    s = _daemon(env={"KVBEAM_TLS_CERT": str(cert), "KVBEAM_TLS_KEY": str(key),
                     "KVBEAM_TLS_CA": str(pki.ca)})
    assert s.tls and s.mode == "mtls"


@pytest.mark.parametrize(("argv", "needle"), [
    (("--auth-token", "a", "--auth-token-file", "f"), "not both"),
    (("--auth-token-file", "/nonexistent/token"), "--auth-token-file: cannot read"),
    (("--tls-cert", "c.pem"), "missing --tls-key, --tls-ca"),
    (("--tls-cert", "/nonexistent.pem", "--tls-key", "k", "--tls-ca", "ca"),
     "--tls-cert: cannot read /nonexistent.pem"),
    (("--tls-server-name", "x"), "--tls-server-name is set but TLS is not"),
    (("--listen", "0.0.0.0:7000"), "refusing to listen on 0.0.0.0:7000 without authentication"),
])
def test_settings_refusals_name_the_flag(argv: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        _daemon(*argv)


def test_settings_insecure_and_non_pem(tmp_path: Path) -> None:
    assert _daemon("--listen", "0.0.0.0:7000", "--insecure", "true").insecure
    assert _daemon("--listen", "0.0.0.0:7000", "--insecure").insecure  # a bare flag
    assert _daemon("--listen", "0.0.0.0:7000", env={"KVBEAM_INSECURE": "1"}).insecure
    assert not _daemon("--listen", "0.0.0.0:7000", "--auth-token", "t").insecure
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError, match="holds no PEM certificate"):
        _daemon("--tls-cert", str(junk), "--tls-key", str(junk), "--tls-ca", str(junk))
    with pytest.raises(ConfigError, match="empty"):
        (tmp_path / "empty").write_text("\n")
        _daemon("--auth-token-file", str(tmp_path / "empty"))


def test_client_commands_resolve_the_same_variables(tmp_path: Path) -> None:
    assert client_security(None, {"KVBEAM_AUTH_TOKEN": "t"}).token == "t"
    assert client_security(None, {}).mode == "none"


# ---- daemons and the CLI, end to end --------------------------------------------------------


def test_daemons_over_mtls_and_every_client(pki: Pki, tmp_path: Path) -> None:
    from tests.daemon_helpers import pair

    scheduler = pki.flags("scheduler")
    sec = Security(tls_cert=scheduler[1], tls_key=scheduler[3], tls_ca=scheduler[5])
    with pair(prefill_extra=pki.flags("prefill"), decode_extra=pki.flags("decode"),
              security=sec) as (prefill, decode, p, d):
        # Prefill's channel to decode and decode's to prefill (Abort, heartbeats) use mTLS.
        result = run_request(p, d, "mtls-1", 3000, 1)
        assert result.ok, result
        r = run_cli("status", "--address", decode.address, "--request-id", "mtls-1", "--json",
                    *scheduler)
        assert r.returncode == 0 and json.loads(r.stdout)["request_id"] == "mtls-1", r.stderr
        r = run_cli("status", "--address", decode.address, "--request-id", "mtls-1")
        assert r.returncode == 2 and "requires mTLS" in r.stderr, r.stderr
        r = run_cli("drive", "--prefill", prefill.address, "--decode", decode.address,
                    "--requests", "2", "--prefix", "mtls-drive", *scheduler)
        assert r.returncode == 0 and "2/2 Success" in r.stdout, r.stdout + r.stderr
        with KvbeamClient(decode.address, security=Security(token="x")) as anonymous:
            assert not anonymous.healthy(timeout=2)  # mTLS guards health too


def test_daemons_with_a_token_file(tmp_path: Path) -> None:
    from tests.daemon_helpers import pair

    token = tmp_path / "token"
    token.write_text("daemon-token\n")
    flags = ["--auth-token-file", str(token)]
    with pair(prefill_extra=flags, decode_extra=flags,
              security=Security(token="daemon-token")) as (prefill, decode, p, d):
        assert run_request(p, d, "tok-1", 2000, 2).ok
        r = run_cli("reserve", "--address", decode.address, "--request-id", "tok-2", "--seq-len",
                    "10", "--prefill", prefill.address, "--auth-token", "wrong")
        assert r.returncode == 2 and "refused our credentials" in r.stderr, r.stderr
        assert "UNAUTHENTICATED" in r.stderr
        r = run_cli("reserve", "--address", decode.address, "--request-id", "tok-2", "--seq-len",
                    "10", "--prefill", prefill.address, "--auth-token-file", str(token))
        assert r.returncode == 0, r.stderr
        for verb in ("abort", "release"):
            r = run_cli(verb, "--address", decode.address, "--request-id", "tok-2")
            assert r.returncode == 2 and "UNAUTHENTICATED" in r.stderr, (verb, r.stderr)
        assert "refused: a wrong auth token" in decode.output
