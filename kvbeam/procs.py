"""Start kvbeam daemons as separate, fresh processes (never forked after torch work).

Used by ``kvbeam demo``, the tests and the benchmarks. Each daemon binds port 0
unless told otherwise and prints its address; :func:`start_daemon` waits for that
line and for the health service.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient
from kvbeam.errors import DaemonStartError

_READY = re.compile(r"kvbeam (\w+) listening on (\S+) instance (\S+) transport (\w+)"
                    r"(?: metrics (\S+))?")


@dataclass
class DaemonProcess:
    """A running daemon process and what it reported."""

    role: str
    proc: subprocess.Popen[str]
    address: str
    instance_id: str
    transport: str
    lines: list[str] = field(default_factory=list)
    #: HOST:PORT of its Prometheus /metrics endpoint ("" when it serves none).
    metrics: str = ""

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    @property
    def output(self) -> str:
        """Everything the daemon printed so far (stdout and stderr)."""
        return "".join(self.lines)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def spawn_daemon(role: str, config: str, *, listen: str = "127.0.0.1:0",
                 extra: Sequence[str] = (), env: dict[str, str] | None = None,
                 security: Security | None = None) -> PendingDaemon:
    """Start ``kvbeam ROLE`` as a subprocess without waiting (see :meth:`PendingDaemon.ready`).

    ``security`` is what the readiness check presents; the daemon's own credentials
    come from ``extra`` flags or ``env`` (KVBEAM_AUTH_TOKEN, KVBEAM_TLS_*).

    Starting several daemons first and waiting afterwards overlaps their start-up
    (``import torch`` alone takes about a minute under TCG).
    """
    cmd = [sys.executable, "-m", "kvbeam.cli", role, "--config", config, "--listen", listen,
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, bufsize=1)
    return PendingDaemon(role, proc, security)


class PendingDaemon:
    """A daemon process that has not reported ready yet; collects its output."""

    def __init__(self, role: str, proc: subprocess.Popen[str],
                 security: Security | None = None) -> None:
        self.role = role
        self.proc = proc
        self.security = security
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._found: list[re.Match[str]] = []
        threading.Thread(target=self._pump, daemon=True, name=f"kvbeam-{role}-output").start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _READY.search(line)
            if m and not self._found:
                self._found.append(m)
                self._ready.set()
        self._ready.set()

    def ready(self, timeout: float = 180.0) -> DaemonProcess:
        """Wait for the ready line and SERVING health; kill and raise on failure."""
        if not self._ready.wait(timeout) or not self._found:
            self.proc.kill()
            self.proc.wait(5)
            raise DaemonStartError(
                f"kvbeam {self.role} did not start (exit code {self.proc.returncode})",
                "".join(self.lines))
        m = self._found[0]
        daemon = DaemonProcess(self.role, self.proc, m.group(2), m.group(3), m.group(4),
                               self.lines, m.group(5) or "")
        with KvbeamClient(local_address(daemon.address), security=self.security) as client:
            if not client.wait_healthy(30.0):
                daemon.stop()
                raise DaemonStartError(f"kvbeam {self.role} never reported SERVING",
                                       daemon.output)
        return daemon


#: wildcard hosts a daemon may bind, and the loopback address that reaches each from here
_LOOPBACK_FOR_WILDCARD = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}


def local_address(address: str) -> str:
    """``address`` as this machine dials it: a wildcard host (``0.0.0.0``, ``[::]``) becomes
    loopback (a wildcard names no address to send to), anything else stays as it is."""
    host, sep, port = address.rpartition(":")
    loopback = _LOOPBACK_FOR_WILDCARD.get(host)
    return f"{loopback}{sep}{port}" if loopback else address


def start_daemon(role: str, config: str, *, listen: str = "127.0.0.1:0",
                 extra: Sequence[str] = (), env: dict[str, str] | None = None,
                 timeout: float = 180.0, security: Security | None = None) -> DaemonProcess:
    """Start ``kvbeam ROLE`` as a subprocess; return once it serves (health SERVING)."""
    return spawn_daemon(role, config, listen=listen, extra=extra, env=env,
                        security=security).ready(timeout)
