"""Run a daemon in the foreground until SIGTERM or SIGINT, then shut down cleanly."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import DaemonSettings

log = logging.getLogger(__name__)


def run_daemon(settings: DaemonSettings, ready: threading.Event | None = None,
               stop: threading.Event | None = None) -> int:
    """Build the runtime for ``settings.role``, serve until a signal (or ``stop``), tear down.

    Prints one line ``kvbeam ROLE listening on HOST:PORT instance ID transport KIND`` (then
    `` metrics HOST:PORT`` when /metrics is served) on stdout once serving, for scripts and
    tests that start daemons as processes.
    """
    from kvbeam.server.api.decode import DecodeServicer
    from kvbeam.server.api.prefill import PrefillServicer

    stop = stop or threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: shutting down", signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    runtime = Runtime(settings)
    try:
        servicer = (DecodeServicer(runtime) if settings.role == "decode"
                    else PrefillServicer(runtime))
        address = runtime.start(servicer)
        metrics = f" metrics {runtime.metrics_address}" if runtime.metrics_address else ""
        print(f"kvbeam {settings.role} listening on {address} instance "
              f"{runtime.local.instance_id} transport {runtime.transport.kind}{metrics}",
              flush=True)
        if ready is not None:
            ready.set()
        stop.wait()
    finally:
        runtime.stop()
    sys.stdout.flush()
    return 0
