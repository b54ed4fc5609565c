"""Settings: the daemons' options (flags and ``KVBEAM_*`` variables) and the control plane's.

The flag wins over the variable, the variable over the default. Containers set
variables; operators at a shell use flags. ``kvbeam prefill --help`` prints both.
:class:`ControlOptions` are the settings of a control server or client (thread
pool, size limits, deadline, authentication), derived from the daemon settings.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvbeam.auth import INSECURE_ENV, Security, load_token, parse_bool
from kvbeam.errors import ConfigError
from kvbeam.pools.sub_batches import MAX_SUB_BATCH_BYTES, MIN_SUB_BATCH_BYTES
from kvbeam.transport.options import MAX_QPS_PER_PEER, POSTER_KINDS

#: Default deadline of every control RPC, seconds (the daemons' KVBEAM_RPC_TIMEOUT_S
#: default too). A handshake takes milliseconds; the margin covers a loaded host.
DEFAULT_RPC_TIMEOUT_S = 5.0
#: The integrity digests' threads by default (--digest-threads): one per core, at most
#: four (a large request's digests are memory bound beyond a few cores, and the daemon's
#: other threads need the rest; docs/performance.md, "Integrity beside the wire").
DEFAULT_DIGEST_THREADS = min(4, os.cpu_count() or 1)
#: Largest message either side accepts (a 61-layer DSV4 SideInfo is ~20 KB).
MAX_MESSAGE_BYTES = 16 << 20
#: Largest header/trailer block accepted. The rejection trailer carries the
#: server's metadata and every difference; gRPC's 8 KiB default is too small.
MAX_METADATA_BYTES = 4 << 20


@dataclass(frozen=True)
class ControlOptions:
    """Settings of a control server or client.

    Attributes:
        rpc_timeout_s: deadline of each client RPC (handshake included).
        max_workers: server handler threads (streaming WatchStatus holds one each).
        max_message_bytes: largest request/reply accepted and sent.
        max_metadata_bytes: largest header/trailer block accepted.
        security: how the server authenticates callers and channels authenticate
            themselves (default: none, loopback only).
    """

    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
    max_workers: int = 16
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_metadata_bytes: int = MAX_METADATA_BYTES
    security: Security = field(default_factory=Security)

    def __post_init__(self) -> None:
        if not self.rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {self.rpc_timeout_s}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.max_message_bytes < 1 << 16 or self.max_metadata_bytes < 1 << 16:
            raise ValueError("max_message_bytes and max_metadata_bytes must be >= 64 KiB")

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server arguments implementing these settings."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", self.max_metadata_bytes),
        ]


@dataclass(frozen=True)
class Option:
    """One setting: attribute name, flag, environment variable, type, default and help.

    ``env`` "": a flag only, with no variable (``--enable-fault-injection``: nothing in
    a daemon's environment alone may switch it on).
    """

    name: str
    env: str
    kind: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return "--" + self.name.replace("_", "-")


def _uids(text: str) -> tuple[int, ...]:
    """Comma-separated uids (a repeated flag arrives joined)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit():
            raise ValueError(f"not a uid: {part!r}")
        out.append(int(part))
    return tuple(out)


#: Credentials: daemons use them for their server and their channels to peers; the
#: scheduler commands (reserve, send, drive, ...) take the same flags and variables.
AUTH_OPTIONS: tuple[Option, ...] = (
    Option("tls_cert", "KVBEAM_TLS_CERT", str, "",
           "mTLS: PEM certificate (chain) of this side, presented as server and as client"),
    Option("tls_key", "KVBEAM_TLS_KEY", str, "", "mTLS: PEM private key of --tls-cert"),
    Option("tls_ca", "KVBEAM_TLS_CA", str, "",
           "mTLS: PEM CA bundle that must have signed every peer's certificate"),
    Option("tls_server_name", "KVBEAM_TLS_SERVER_NAME", str, "",
           "mTLS: name to verify in peers' server certificates (default: the host dialled)"),
    Option("auth_token", "KVBEAM_AUTH_TOKEN", str, "",
           "shared-token auth (development): every RPC must carry this token"),
    Option("auth_token_file", "KVBEAM_AUTH_TOKEN_FILE", str, "",
           "read the shared token from this file's first line (keeps it out of ps)"),
)

OPTIONS: tuple[Option, ...] = (
    Option("config", "KVBEAM_CONFIG", str, None,
           "side config YAML (pools); required with --pools own; optional with --pools "
           "engine, where the daemon takes the attaching engine's description and, given "
           "this, refuses an engine whose description differs (every field named)"),
    Option("listen", "KVBEAM_LISTEN", str, None,
           "HOST:PORT of the gRPC control server (default 127.0.0.1:50051 prefill, "
           "127.0.0.1:50052 decode)"),
    Option("advertise", "KVBEAM_ADVERTISE", str, "",
           "HOST:PORT peers use to reach this daemon (default: --listen)"),
    Option("peer_port", "KVBEAM_PEER_PORT", int, 0,
           "decode: TCP port of the peer channel (the daemons' only way to each other after "
           "the handshake: offers, BeginWrite, aborts, heartbeats), on the --listen host "
           "(default: any free port; each handshake reply names it)"),
    Option("transport", "KVBEAM_TRANSPORT", str, "auto",
           "data plane: auto (RDMA device given or found, else TCP), rdma, or tcp",
           ("auto", "rdma", "tcp")),
    Option("rdma_device", "KVBEAM_RDMA_DEVICE", str, "",
           "RDMA device name, e.g. rxe0 or mlx5_0 (default: the first device found)"),
    Option("rdma_gid_index", "KVBEAM_RDMA_GID_INDEX", int, 0, "GID index on the RDMA port"),
    Option("data_host", "KVBEAM_DATA_HOST", str, "",
           "TCP transport: address the data listener binds and advertises "
           "(default: the control host)"),
    Option("pool_device", "KVBEAM_POOL_DEVICE", str, "cpu",
           "device for the pools: cpu (host memory, no torch) or cuda[:N] (torch)"),
    # --- engine attach (docs/engine.md) ---
    Option("pools", "KVBEAM_POOLS", str, "own",
           "own: allocate the pools from --config at start; engine: serve an engine's own "
           "memory, attached over --attach-socket (NOT_SERVING until it attaches)",
           ("own", "engine")),
    Option("attach_socket", "KVBEAM_ATTACH_SOCKET", str, "",
           "--pools engine: Unix socket engines attach on (default "
           "$XDG_RUNTIME_DIR/kvbeam/ROLE-PORT.sock, else /tmp/kvbeam-UID/ROLE-PORT.sock)"),
    Option("attach_allow_uid", "KVBEAM_ATTACH_ALLOW_UID", _uids, (),
           "--pools engine: a uid besides the daemon's own that may attach (repeatable; "
           "variable: comma-separated); checked on connect, before anything is read. The "
           "socket stays mode 0600: give --attach-group so that uid can connect"),
    Option("attach_group", "KVBEAM_ATTACH_GROUP", str, "",
           "--pools engine: a group (name or gid) whose members may connect to the attach "
           "socket (it gets that group and mode 0660; its directory needs the group's x "
           "bit); only uids of --attach-allow-uid are then admitted. Empty: mode 0600"),
    Option("deadline_bootstrap_s", "KVBEAM_DEADLINE_BOOTSTRAP_S", float, 10.0,
           "seconds allowed in Bootstrapping (handshake, reservation lease)"),
    Option("deadline_waiting_s", "KVBEAM_DEADLINE_WAITING_S", float, 30.0,
           "seconds allowed in WaitingForInput (between chunks)"),
    Option("deadline_transfer_s", "KVBEAM_DEADLINE_TRANSFER_S", float, 30.0,
           "seconds allowed in Transferring without progress"),
    Option("transfer_floor_mbps", "KVBEAM_TRANSFER_FLOOR_MBPS", float, 100.0,
           "slowest wire rate assumed, MB/s: Transferring allows a request of N bytes at "
           "least N / rate seconds (beyond --deadline-transfer-s), so a large request on a "
           "congested wire is not failed while it still moves"),
    Option("handoff_lease_s", "KVBEAM_HANDOFF_LEASE_S", float, 30.0,
           "decode: seconds a slot stays held after Success until Release"),
    Option("send_wait_s", "KVBEAM_SEND_WAIT_S", float, 10.0,
           "prefill: seconds a Send that arrived before decode's reservation waits for it "
           "(WaitingForInput, its source pages held; a Send naming no decode waits for the "
           "Offer of the decode that reserves it); then it fails with reason timeout"),
    Option("rpc_timeout_s", "KVBEAM_RPC_TIMEOUT_S", float, 5.0,
           "deadline of every call to a peer (a handshake, Connect, a request on the peer "
           "channel)"),
    Option("heartbeat_s", "KVBEAM_HEARTBEAT_S", float, 1.0,
           "seconds between heartbeats on each peer channel"),
    Option("peer_timeout_s", "KVBEAM_PEER_TIMEOUT_S", float, 10.0,
           "seconds a peer may leave its peer channel silent (past one heartbeat interval) "
           "before it is declared lost; also how long a connection may go without an open "
           "peer channel before it is dropped"),
    Option("max_inflight", "KVBEAM_MAX_INFLIGHT", int, 256,
           "transfers in flight on this side before new ones get RESOURCE_EXHAUSTED"),
    Option("integrity", "KVBEAM_INTEGRITY", parse_bool, True,
           "verify XXH3-128 digests of every transfer on decode (true/false)"),
    Option("digest_threads", "KVBEAM_DIGEST_THREADS", int, DEFAULT_DIGEST_THREADS,
           "threads that compute a request's integrity digests in parallel over its buffers "
           "(prefill while its writes are in flight, decode once they landed); default one "
           "per core, at most 4; 0: on the request's executor thread"),
    Option("verify_sub_batch_mib", "KVBEAM_VERIFY_SUB_BATCH_MIB", float, 16.0,
           "decode, integrity on: a request of at least twice this many MiB, written in one "
           "chunk, is verified in sub-batches of about this size as each lands (at most 16 "
           "per request), so Success waits only for the last one's digests; 0: verify each "
           "request whole once it landed"),
    Option("fill_seed", "KVBEAM_FILL_SEED", int, -1,
           "fill the pools with a deterministic pattern from this seed at start (demo and "
           "tests; -1: leave them zeroed)"),
    Option("log_level", "KVBEAM_LOG_LEVEL", str, "INFO", "DEBUG, INFO, WARNING or ERROR",
           ("DEBUG", "INFO", "WARNING", "ERROR")),
    Option("log_requests", "KVBEAM_LOG_REQUESTS", parse_bool, False,
           "log each request's progress at INFO (decode reserved it, prefill posted it, "
           "Success on each side, the slot freed: logger kvbeam.requests; on at --log-level "
           "DEBUG too); off, a request that goes well logs nothing, saving each daemon about "
           "0.1 ms of CPU per small request; failures are logged either way (true/false)"),
    Option("log_ends_per_s", "KVBEAM_LOG_ENDS_PER_S", float, 10.0,
           "one INFO line per ended transfer (logger kvbeam.transfers: Success or Failed with "
           "its cause, bytes, ms, verification), at most this many a second; the ends past "
           "that are counted in one line every 10 s; 0: none"),
    Option("log_format", "KVBEAM_LOG_FORMAT", str, "text",
           "log lines as text, or json: one object per line with timestamp, level, logger, "
           "message, role, request_id and peer", ("text", "json")),
    Option("metrics", "KVBEAM_METRICS", str, "",
           "HOST:PORT of the Prometheus /metrics endpoint (port 0: any free port); "
           "empty: no endpoint"),
    *AUTH_OPTIONS,
    Option("insecure", INSECURE_ENV, parse_bool, False,
           "allow a non-loopback --listen without authentication (true/false)"),
    Option("per_peer_rkeys", "KVBEAM_PER_PEER_RKEYS", parse_bool, True,
           "RDMA decode: each peer gets its own rkeys (memory windows over the pools' one "
           "registration), revoked when it goes (false, or a device without memory "
           "windows: one shared set, valid until the daemon stops)"),
    Option("rdma_qp_timeout", "KVBEAM_RDMA_QP_TIMEOUT", int, 17,
           "RDMA: the RC QP's ack timeout exponent, 4.096 us * 2**N per try (0-31; 17: 0.54 s)"),
    Option("rdma_retry_cnt", "KVBEAM_RDMA_RETRY_CNT", int, 7,
           "RDMA: RC QP retries before IBV_WC_RETRY_EXC_ERR (0-7)"),
    Option("qps_per_peer", "KVBEAM_QPS_PER_PEER", int, 1,
           "RDMA: RC queue pairs per peer link; large requests are striped over them "
           "(1-16; both sides of a link must agree)"),
    Option("rdma_poster", "KVBEAM_RDMA_POSTER", str, "auto",
           "RDMA: how WR chains are posted: auto (the compiled helper built at install, else "
           "pyverbs objects, logged at start), compiled (refuse to start without it), or "
           "pyverbs (one pyverbs SendWR per WR: the fallback, slower)", POSTER_KINDS),
    Option("resend_retries", "KVBEAM_RESEND_RETRIES", int, 2,
           "prefill: resends of a request on a new link after a transient transport error "
           "(retries exhausted, a broken link), each within the request's deadline; 0: such "
           "an error fails the request at once"),
    Option("enable_fault_injection", "", parse_bool, False,
           "TEST ONLY: arm the fault hooks that KVBEAM_FAULT_* variables name "
           "(docs/faults.md), logged as a WARNING at start; without it they are ignored. "
           "Never in production; a flag only, no variable"),
)


@dataclass(frozen=True)
class DaemonSettings:
    """Resolved settings of one daemon (see :data:`OPTIONS` for meanings)."""

    role: str
    config: str
    listen: str
    advertise: str
    peer_port: int
    transport: str
    rdma_device: str
    rdma_gid_index: int
    data_host: str
    pool_device: str
    deadline_bootstrap_s: float
    deadline_waiting_s: float
    deadline_transfer_s: float
    handoff_lease_s: float
    send_wait_s: float
    rpc_timeout_s: float
    heartbeat_s: float
    peer_timeout_s: float
    max_inflight: int
    integrity: bool
    fill_seed: int
    log_level: str
    log_format: str
    metrics: str
    security: Security = field(default_factory=Security)
    per_peer_rkeys: bool = True
    rdma_qp_timeout: int = 17
    rdma_retry_cnt: int = 7
    qps_per_peer: int = 1
    rdma_poster: str = "auto"
    transfer_floor_mbps: float = 100.0
    pools: str = "own"
    attach_socket: str = ""
    attach_allow_uid: tuple[int, ...] = ()
    attach_group: str = ""
    resend_retries: int = 2
    digest_threads: int = DEFAULT_DIGEST_THREADS
    verify_sub_batch_mib: float = 16.0
    enable_fault_injection: bool = False
    log_requests: bool = False
    log_ends_per_s: float = 10.0

    def transfer_budget_s(self, nbytes: int) -> float:
        """Seconds Transferring allows a request of ``nbytes``: the deadline, or the bytes
        at the floor rate when that is longer."""
        return max(self.deadline_transfer_s, nbytes / (self.transfer_floor_mbps * 1e6))

    @property
    def advertised(self) -> str:
        """The control address peers should use."""
        return self.advertise or self.listen


DEFAULT_PORTS = {"prefill": 50051, "decode": 50052}


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option as a flag; defaults stay None so the environment can fill them."""
    _add_arguments(parser, OPTIONS)


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the credential flags (:data:`AUTH_OPTIONS`) to a client command."""
    _add_arguments(parser, AUTH_OPTIONS)


def _add_arguments(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    for opt in options:
        kw: dict[str, Any] = {"default": None, "dest": opt.name,
                              "help": f"{opt.help} [env {opt.env}]" if opt.env else opt.help}
        if opt.choices:
            kw["choices"] = opt.choices
        if opt.kind is parse_bool:  # a bare --insecure means true
            kw.update(nargs="?", const="true")
        if opt.kind is _uids:  # repeatable
            kw["action"] = "append"
        parser.add_argument(opt.flag, **kw)


def env_help() -> str:
    """The environment-variable table for ``--help`` epilogs."""
    width = max(len(o.env) for o in OPTIONS)
    lines = ["environment (a flag overrides its variable):"]
    for o in (o for o in OPTIONS if o.env):
        default = "-" if o.default in (None, "", ()) else o.default
        lines.append(f"  {o.env:<{width}}  {o.flag} (default: {default})")
    return "\n".join(lines)


def resolve(role: str, args: argparse.Namespace | None = None,
            environ: Mapping[str, str] | None = None) -> DaemonSettings:
    """Merge flags, environment and defaults; refuse bad values naming the flag and variable."""
    values: dict[str, Any] = {"role": role, **_values(OPTIONS, args, environ)}
    if not values["config"] and values["pools"] != "engine":
        raise ConfigError("--config (or KVBEAM_CONFIG) is required: the side config YAML "
                          "(or --pools engine: an engine attaches its own pools)")
    values["config"] = values["config"] or ""
    if not values["listen"]:
        values["listen"] = f"127.0.0.1:{DEFAULT_PORTS[role]}"
    for name in ("deadline_bootstrap_s", "deadline_waiting_s", "deadline_transfer_s",
                 "handoff_lease_s", "send_wait_s", "rpc_timeout_s", "heartbeat_s", "peer_timeout_s",
                 "transfer_floor_mbps"):
        if values[name] <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be positive "
                              f"(got {values[name]})")
    if values["digest_threads"] < 0:
        raise ConfigError(f"--digest-threads: must be 0 or more (got {values['digest_threads']})")
    sub_batch = values["verify_sub_batch_mib"]
    if sub_batch and not (MIN_SUB_BATCH_BYTES <= sub_batch * (1 << 20) <= MAX_SUB_BATCH_BYTES):
        raise ConfigError(f"--verify-sub-batch-mib: 0 (off) or {MIN_SUB_BATCH_BYTES / (1 << 20):g}"
                          f" to {MAX_SUB_BATCH_BYTES >> 20} (got {sub_batch:g})")
    if values["log_ends_per_s"] < 0:
        raise ConfigError(f"--log-ends-per-s: must be 0 or more (got {values['log_ends_per_s']})")
    if values["resend_retries"] < 0:
        raise ConfigError(f"--resend-retries: must be 0 or more (got {values['resend_retries']})")
    if not 1 <= values["qps_per_peer"] <= MAX_QPS_PER_PEER:
        raise ConfigError(f"--qps-per-peer: must be 1 to {MAX_QPS_PER_PEER} "
                          f"(got {values['qps_per_peer']})")
    if not 0 <= values["peer_port"] <= 65535:
        raise ConfigError(f"--peer-port: must be 0 to 65535 (got {values['peer_port']})")
    if values["max_inflight"] <= 0:
        raise ConfigError(f"--max-inflight: must be positive (got {values['max_inflight']})")
    _check_hostport(values["listen"], "--listen", allow_zero=True)
    if values["advertise"]:
        _check_hostport(values["advertise"], "--advertise")
    if values["metrics"]:
        _check_hostport(values["metrics"], "--metrics", allow_zero=True)
    values["security"] = _security(values)
    # Refuse an open non-loopback control plane before allocating pools (the server checks too).
    values["security"].check_bind(values["listen"])
    names = {f.name for f in fields(DaemonSettings)}
    return DaemonSettings(**{k: v for k, v in values.items() if k in names})


def resolve_security(args: argparse.Namespace | None = None,
                     environ: Mapping[str, str] | None = None) -> Security:
    """A client command's credentials from :data:`AUTH_OPTIONS` flags and variables."""
    return _security(_values(AUTH_OPTIONS, args, environ))


def _security(values: Mapping[str, Any]) -> Security:
    """Build and load the credentials (files read now: errors name the flag)."""
    return Security(
        tls_cert=values["tls_cert"], tls_key=values["tls_key"], tls_ca=values["tls_ca"],
        tls_server_name=values["tls_server_name"],
        token=load_token(values["auth_token"], values["auth_token_file"]),
        insecure=bool(values.get("insecure", False))).load()


def _values(options: tuple[Option, ...], args: argparse.Namespace | None,
            environ: Mapping[str, str] | None) -> dict[str, Any]:
    """Flag, else variable, else default, for each option; bad values name their source."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for opt in options:
        raw = getattr(args, opt.name, None) if args is not None else None
        if isinstance(raw, list):  # a repeated flag
            raw = ",".join(raw)
        source = opt.flag
        if raw is None and opt.env and opt.env in env:
            raw, source = env[opt.env], opt.env
        if raw is None:
            values[opt.name] = opt.default
            continue
        try:
            value = opt.kind(raw) if isinstance(raw, str) else raw
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        if opt.choices and value not in opt.choices:
            raise ConfigError(f"{source}: {value!r} is not one of {', '.join(opt.choices)}")
        values[opt.name] = value
    return values


def _check_hostport(text: str, source: str, allow_zero: bool = False) -> None:
    """HOST:PORT; port 0 (any free port) only where ``allow_zero``."""
    host, sep, port = text.rpartition(":")
    lowest = 0 if allow_zero else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) < 65536:
        raise ConfigError(f"{source}: expected HOST:PORT with a port {lowest}..65535 "
                          f"(got {text!r})")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # Peers would refuse it at the handshake (proto.fields.host_port): say so at start.
        raise ConfigError(f"{source}: an IPv6 host needs brackets, e.g. [fd00::1]:50052 "
                          f"(got {text!r})")
