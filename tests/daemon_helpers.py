"""Start prefill/decode daemon pairs as separate processes for the lifecycle tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess, PendingDaemon, spawn_daemon, start_daemon
from tests.fixtures import shipped_config

#: Request slots of the shipped decode configs (docker/config/decode*.yaml).
DECODE_SLOTS = 16
#: Short deadlines keep fault tests fast; far below sglang's 300 s either way.
FAST = ["--deadline-bootstrap-s", "4", "--deadline-waiting-s", "4",
        "--deadline-transfer-s", "6", "--heartbeat-s", "0.5", "--rpc-timeout-s", "2",
        "--handoff-lease-s", "30", "--log-level", "INFO"]
#: The same under TCG (the RDMA suite's guest runs 16-40x slower): a first handshake there,
#: with QP creation and eight requests arriving at once, has taken more than 4 s, and a
#: busy prefill has missed two 0.5 s heartbeats. A killed peer is still noticed at once
#: (its heartbeat is refused, not timed out). Its soft-RoCE wire moves about 7 MB/s in all
#: with eight requests in flight (the fifty-request test: 307 MB in 40-45 s), about 1 MB/s
#: each, less with a second guest on the host: far below the 100 MB/s the default
#: --transfer-floor-mbps assumes. A 10 MB request (uni-0, 31486 tokens) took 8.2 s from
#: Send to Success of its 10 s Transferring budget in a passing run, and under more load timed
#: out on decode (no progress in Transferring) while prefill's writes completed.
SLOW_GUEST = ["--deadline-bootstrap-s", "20", "--deadline-waiting-s", "20",
              "--deadline-transfer-s", "10", "--transfer-floor-mbps", "0.5",
              "--heartbeat-s", "1", "--rpc-timeout-s", "8",
              "--handoff-lease-s", "60", "--log-level", "INFO"]


#: Start-up budget: tens of seconds in the TCG guest (imports, pool fill, registration),
#: minutes on a loaded machine.
STARTUP_S = 300.0


def _args(role: str, transport: str, extra: Sequence[str]) -> list[str]:
    seed = "1" if role == "prefill" else "2"
    deadlines = SLOW_GUEST if transport == "rdma" else FAST
    return ["--transport", transport, "--fill-seed", seed, *deadlines, *extra]


def start(role: str, *, paged: bool = False, transport: str = "tcp",
          extra: Sequence[str] = (), cfg: str | None = None, listen: str = "127.0.0.1:0",
          env: dict[str, str] | None = None, security: Security | None = None) -> DaemonProcess:
    """A daemon with fast deadlines and a fill pattern (prefill seed 1, decode seed 2).

    ``security``: what the readiness check presents (the daemon's own go in ``extra``).
    """
    return start_daemon(role, cfg or shipped_config(role, paged), listen=listen,
                        extra=_args(role, transport, extra), env=env, timeout=STARTUP_S,
                        security=security)


def spawn(role: str, *, transport: str = "tcp", extra: Sequence[str] = (),
          env: dict[str, str] | None = None, cfg: str | None = None,
          listen: str = "127.0.0.1:0") -> PendingDaemon:
    """Start a daemon like :func:`start` without waiting (call ``.ready(STARTUP_S)``)."""
    return spawn_daemon(role, cfg or shipped_config(role), listen=listen,
                        extra=_args(role, transport, extra), env=env)


def start_both(*, paged: bool = False, transport: str = "tcp", decode_extra: Sequence[str] = (),
               prefill_extra: Sequence[str] = (), security: Security | None = None,
               prefill_env: dict[str, str] | None = None,
               decode_env: dict[str, str] | None = None) -> tuple[DaemonProcess, DaemonProcess]:
    """Start decode and prefill at the same time (their start-ups overlap); (prefill, decode).

    ``security``: what the readiness check presents (the daemons' own credentials go
    in the ``*_extra`` flags). ``*_env``: extra environment (fault hooks).
    """
    d = spawn_daemon("decode", shipped_config("decode", paged),
                     extra=_args("decode", transport, decode_extra), env=decode_env,
                     security=security)
    p = spawn_daemon("prefill", shipped_config("prefill", paged),
                     extra=_args("prefill", transport, prefill_extra), env=prefill_env,
                     security=security)
    try:
        decode = d.ready(STARTUP_S)
    except BaseException:
        p.proc.kill()
        raise
    try:
        return p.ready(STARTUP_S), decode
    except BaseException:
        decode.stop()
        raise


@contextmanager
def pair(*, paged: bool = False, transport: str = "tcp", decode_extra: Sequence[str] = (),
         prefill_extra: Sequence[str] = (), security: Security | None = None,
         prefill_env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None
         ) -> Iterator[tuple[DaemonProcess, DaemonProcess, KvbeamClient, KvbeamClient]]:
    """A running prefill/decode pair and a client to each (presenting ``security``);
    everything stopped afterwards."""
    prefill, decode = start_both(paged=paged, transport=transport, decode_extra=decode_extra,
                                 prefill_extra=prefill_extra, security=security,
                                 prefill_env=prefill_env, decode_env=decode_env)
    try:
        with KvbeamClient(prefill.address, security=security) as p, \
                KvbeamClient(decode.address, security=security) as d:
            yield prefill, decode, p, d
    finally:
        prefill.stop()
        decode.stop()


def free_slots(d: KvbeamClient, most: int = DECODE_SLOTS) -> int:
    """How many request slots decode has free right now (its Heartbeat's capacity).

    ``most`` free means no slot leaked; a pool of another size is refused. (Counted, not
    probed with reservations: a reservation naming a prefill decode cannot reach now fails
    at once, decode-initiated pairing, so probes would free their own slots.)
    """
    cap = d.capacity()
    if cap.slots != most:
        raise AssertionError(f"decode has {cap.slots} request slots, the test expects {most}")
    return cap.free


def rss_kib(pid: int) -> int:
    """Resident set size of a process (VmRSS), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
