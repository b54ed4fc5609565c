"""Control-plane authentication: the one place that builds credentials, for servers and channels.

Two mechanisms, usable alone or together (:class:`Security`):

- **mTLS** (``--tls-cert``, ``--tls-key``, ``--tls-ca``): grpcio's own TLS. The
  server demands a client certificate signed by the CA
  (``require_client_auth=True``); channels present this side's certificate and
  verify the server's against the same CA. A peer without a valid certificate
  fails in the TLS handshake, before any RPC runs.
- **Shared token** (``--auth-token`` or ``--auth-token-file``): for development.
  Every call carries ``authorization: Bearer TOKEN``; a server interceptor
  compares it in constant time and answers UNAUTHENTICATED before any servicer
  code runs, so a refused peer learns no address, QPN or rkey. The token is not
  encrypted unless TLS is on as well.

The gRPC health service is exempt from the token (not from TLS, which acts
before any method is known): orchestrator probes cannot send metadata, and the
service reveals nothing but SERVING or NOT_SERVING.

Without either, a server may only bind loopback addresses (a warning is logged at
start-up) unless ``--insecure`` is given; see :meth:`Security.check_bind`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbeam.errors import ConfigError

if TYPE_CHECKING:  # gRPC only where a server or channel is built: kvbeam.auth_grpc
    import grpc

    from kvbeam.auth_grpc import ServerInterceptor

log = logging.getLogger(__name__)

#: Metadata key and scheme of the shared token.
TOKEN_KEY = "authorization"
TOKEN_SCHEME = "Bearer "
#: Method prefix exempt from the token: the standard health service (probes).
EXEMPT_PREFIX = "/grpc.health.v1.Health/"
#: Flags that make the control plane authenticated (named in errors).
AUTH_FLAGS = "--tls-cert/--tls-key/--tls-ca or --auth-token/--auth-token-file"

@dataclass(frozen=True)
class Security:
    """How a control server authenticates callers and a channel authenticates itself.

    Attributes:
        tls_cert: PEM certificate chain of this side (server certificate, and the
            client certificate it presents to peers).
        tls_key: PEM private key of ``tls_cert``.
        tls_ca: PEM CA bundle that must have signed every peer's certificate.
        tls_server_name: name to verify in servers' certificates instead of the
            host of the address dialled ("" : the host).
        token: the shared token ("" : none). Never printed.
        insecure: allow a server without authentication on a non-loopback address.
    """

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""
    token: str = field(default="", repr=False)
    insecure: bool = False

    def __post_init__(self) -> None:
        given = {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key,
                 "--tls-ca": self.tls_ca}
        if any(given.values()) and not all(given.values()):
            missing = ", ".join(k for k, v in given.items() if not v)
            raise ConfigError(f"mTLS needs --tls-cert, --tls-key and --tls-ca together; "
                              f"missing {missing}")
        if self.tls_server_name and not self.tls:
            raise ConfigError("--tls-server-name is set but TLS is not: give --tls-cert, "
                              "--tls-key and --tls-ca as well")
        if self.token != self.token.strip() or any(c in self.token for c in "\r\n\0"):
            raise ConfigError("the auth token must not contain whitespace at its ends, "
                              "newlines or NUL")

    @property
    def tls(self) -> bool:
        """Whether mTLS is configured."""
        return bool(self.tls_cert)

    @property
    def authenticated(self) -> bool:
        """Whether callers must prove who they are (mTLS, a token, or both)."""
        return self.tls or bool(self.token)

    @property
    def mode(self) -> str:
        """``mtls+token``, ``mtls``, ``token`` or ``none`` (for logs)."""
        parts = [p for p, on in (("mtls", self.tls), ("token", bool(self.token))) if on]
        return "+".join(parts) or "none"

    # ---- files -------------------------------------------------------------------
    @functools.cached_property
    def pem(self) -> tuple[bytes, bytes, bytes]:
        """The PEM certificate chain, key and CA bundle (read once; ConfigError naming the
        flag of a file that cannot be read or holds no PEM of its kind)."""
        return (_read_pem(self.tls_cert, "--tls-cert", "CERTIFICATE"),
                _read_pem(self.tls_key, "--tls-key", "PRIVATE KEY"),
                _read_pem(self.tls_ca, "--tls-ca", "CERTIFICATE"))

    def load(self) -> Security:
        """Read and sanity-check the PEM files now (ConfigError naming the flag); returns self."""
        if self.tls:
            self.pem  # noqa: B018 - cached for the server and every channel
        return self

    # ---- server --------------------------------------------------------------------
    def check_bind(self, address: str) -> None:
        """Refuse an unauthenticated server on a non-loopback address without ``insecure``.

        Raises:
            ConfigError: naming the address and the flags that fix it.
        """
        host = address.rpartition(":")[0]
        if self.authenticated or self.insecure or is_loopback(host):
            return
        raise ConfigError(
            f"refusing to listen on {address} without authentication: a non-loopback "
            f"control plane hands out RDMA addresses and rkeys; set {AUTH_FLAGS}, or "
            "--insecure (KVBEAM_INSECURE=true) to accept unauthenticated peers")

    def warn_if_open(self, address: str) -> None:
        """Log at start-up that the control plane accepts anyone (loopback or ``insecure``)."""
        if self.authenticated:
            log.info("control plane on %s: authentication %s%s", address, self.mode,
                     "" if self.tls else " (token in clear text: development only)")
        elif is_loopback(address.rpartition(":")[0]):
            log.warning("control plane on %s has NO authentication: any local process may "
                        "handshake and learn our memory keys (loopback development only; set "
                        "%s)", address, AUTH_FLAGS)
        else:
            log.warning("control plane on %s has NO authentication (--insecure): anyone who "
                        "reaches this port may handshake and write into our memory", address)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """mTLS server credentials that require a client certificate, or None."""
        from kvbeam import auth_grpc

        return auth_grpc.server_credentials(self)

    def server_interceptors(self) -> list[ServerInterceptor]:
        """The token check, when a token is set."""
        from kvbeam import auth_grpc

        return auth_grpc.server_interceptors(self)

    # ---- client --------------------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to ``address`` presenting these credentials (the only way kvbeam dials)."""
        from kvbeam import auth_grpc

        return auth_grpc.channel(self, address, options)


#: the environment variable that allows an unauthenticated server off loopback
INSECURE_ENV = "KVBEAM_INSECURE"


def parse_bool(text: str) -> bool:
    """A boolean setting (``--insecure``, ``KVBEAM_INSECURE``, ...): 1/true/yes/on or
    0/false/no/off, any case; the daemons and the engine integrations read them alike.

    Raises:
        ValueError: anything else (a typo must not quietly mean false).
    """
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


def insecure_from_environment(environ: Mapping[str, str], where: str) -> bool:
    """``KVBEAM_INSECURE`` from ``environ`` (unset: False), as the daemons parse it.

    Raises:
        ConfigError: a value :func:`parse_bool` refuses; the message starts with ``where``.
    """
    if INSECURE_ENV not in environ:
        return False
    try:
        return parse_bool(environ[INSECURE_ENV])
    except ValueError as exc:
        raise ConfigError(f"{where}: {INSECURE_ENV}: {exc}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a literal, ``[v6]`` or a name) names only loopback addresses."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:  # "" binds every interface
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _read_pem(path: str, flag: str, kind: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if f"-----BEGIN {kind}".encode() not in data and not (
            kind == "PRIVATE KEY" and b"PRIVATE KEY-----" in data):
        raise ConfigError(f"{flag}: {path} holds no PEM {kind.lower()}")
    return data


def load_token(token: str, token_file: str) -> str:
    """The shared token from ``--auth-token`` or the first line of ``--auth-token-file``."""
    if token and token_file:
        raise ConfigError("give --auth-token or --auth-token-file, not both")
    if not token_file:
        return token
    try:
        text = Path(token_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--auth-token-file: cannot read {token_file}: {exc}") from None
    lines = text.strip().splitlines()
    if not lines or not lines[0].strip():
        raise ConfigError(f"--auth-token-file: {token_file} is empty")
    return lines[0].strip()


#: The credential settings of the engine integrations that call daemons over gRPC, named
#: as the daemons' flags are (sglang's ``kvbeam_KEY`` attributes or ``KVBEAM_KEY``
#: variables; vLLM's connector refuses them: it calls over its attach socket only). The
#: token only from a file: no secret in an engine's config.
CLIENT_SETTINGS = ("auth_token_file", "tls_cert", "tls_key", "tls_ca", "tls_server_name")


def client_security(settings: Mapping[str, object], where: str) -> Security:
    """The credentials an engine integration presents to kvbeam daemons, from its settings.

    Args:
        settings: any of :data:`CLIENT_SETTINGS` (missing or empty: not used).
        where: what the settings are, for errors (``kvbeam sglang backend``).

    Raises:
        ConfigError: a setting is not a string, the TLS files are incomplete, or a file
            cannot be read; the message starts with ``where`` (files are read now, so a
            bad setting fails at start-up, not at the first request).
    """
    values: dict[str, str] = {}
    for key in CLIENT_SETTINGS:
        value = settings.get(key) or ""
        if not isinstance(value, str):
            raise ConfigError(f"{where}.{key}: a string is needed (got {value!r})")
        values[key] = value
    try:
        return Security(tls_cert=values["tls_cert"], tls_key=values["tls_key"],
                        tls_ca=values["tls_ca"], tls_server_name=values["tls_server_name"],
                        token=load_token("", values["auth_token_file"])).load()
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def same_token(presented: object, expected: str) -> bool:
    """Whether ``presented`` is the token ``expected``, compared in constant time."""
    return isinstance(presented, str) and hmac.compare_digest(_digest(presented),
                                                              _digest(expected))


def _digest(value: str) -> bytes:
    # Hashing first makes the comparison's time independent of the lengths too.
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()
