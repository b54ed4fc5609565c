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

    # The process's main thread, with nothing else to do, serves the daemon's loop itself
    # (one thread fewer); a daemon run on another thread (``stop`` given: in-process
    # tests) starts the loop on a thread of its own and waits for ``stop``.
    here = stop is None and threading.current_thread() is threading.main_thread()
    stop = stop or threading.Event()
    runtime = Runtime(settings)
    # The teardown while the main thread serves the loop: on a thread of its own, since it
    # hands calls to the loop; its end stops the loop (run() returns), whatever it met,
    # and what it raised is raised again on the main thread. Started once.
    failed: list[BaseException] = []

    def tear_down() -> None:
        try:
            runtime.stop()
        except BaseException as exc:  # raised again by the main thread, below
            failed.append(exc)
        finally:
            runtime.loop.stop()  # a no-op when runtime.stop() stopped it

    teardown = threading.Thread(target=tear_down, name="kvbeam-shutdown")
    once = threading.Lock()
    serving = threading.Event()  # the main thread serves the loop (or is about to)

    def begin_teardown() -> None:
        if once.acquire(blocking=False):  # atomic: a signal may interrupt the main thread
            teardown.start()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: shutting down", signal.Signals(signum).name)
        stop.set()
        if serving.is_set():
            begin_teardown()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        servicer = (DecodeServicer(runtime) if settings.role == "decode"
                    else PrefillServicer(runtime))
        address = runtime.start(servicer, loop_here=here)
        metrics = f" metrics {runtime.metrics_address}" if runtime.metrics_address else ""
        print(f"kvbeam {settings.role} listening on {address} instance "
              f"{runtime.local.instance_id} transport {runtime.transport.kind}{metrics}",
              flush=True)
        if ready is not None:
            ready.set()
        if here:
            serving.set()
            if stop.is_set():  # a signal came during the start
                begin_teardown()
            runtime.loop.run()  # until the teardown's end stops it
            teardown.join()
            if failed:
                raise failed[0]
        else:
            stop.wait()
    finally:
        runtime.stop()  # a no-op after the teardown on the signal's thread
    sys.stdout.flush()
    return 0
