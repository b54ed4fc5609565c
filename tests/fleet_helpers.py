"""Many prefill and decode daemons at once: the fleet and N x M tests (host and guest)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess, PendingDaemon
from tests.daemon_helpers import STARTUP_S, rss_kib, spawn
from tests.fixtures import shipped_config
from tests.metrics_helpers import Samples, scrape, value

#: Decode's log line when a request landed (kvbeam.server.core.decode_landing).
_LANDED = re.compile(r"request (\S+): Success \(\d+ bytes landed")


def small_config(role: str, folder: Path, *, slots: int, max_context: int) -> str:
    """The shipped config of ``role`` with ``slots`` request slots of ``max_context`` tokens:
    small pools, so many daemons fit in one machine (or one TCG guest)."""
    text = Path(shipped_config(role)).read_text()
    text = re.sub(r"num_req_slots: \d+", f"num_req_slots: {slots}", text)
    text = re.sub(r"max_context_len: \d+", f"max_context_len: {max_context}", text)
    path = folder / f"{role}-small.yaml"
    path.write_text(text)
    return str(path)


def spawn_role(role: str, cfg: str, *, transport: str = "tcp", listen: str = "127.0.0.1:0",
               extra: Sequence[str] = ()) -> PendingDaemon:
    """One daemon of the fleet, serving metrics on a free port."""
    return spawn(role, transport=transport, cfg=cfg, listen=listen,
                 extra=["--metrics", "127.0.0.1:0", *extra])


@contextmanager
def fleet(n_prefill: int, n_decode: int, folder: Path, *, transport: str = "tcp",
          slots: int = 4, max_context: int = 4096, extra: Sequence[str] = ()
          ) -> Iterator[tuple[list[DaemonProcess], list[DaemonProcess], dict[str, str]]]:
    """``n_prefill`` prefills and ``n_decode`` decodes, all started at once (start-ups
    overlap); yields (prefills, decodes, {"prefill": cfg, "decode": cfg}); all stopped after."""
    cfgs = {role: small_config(role, folder, slots=slots, max_context=max_context)
            for role in ("prefill", "decode")}
    pending = [spawn_role("prefill", cfgs["prefill"], transport=transport, extra=extra)
               for _ in range(n_prefill)]
    pending += [spawn_role("decode", cfgs["decode"], transport=transport, extra=extra)
                for _ in range(n_decode)]
    started: list[DaemonProcess] = []
    try:
        for p in pending:
            started.append(p.ready(STARTUP_S))
        yield started[:n_prefill], started[n_prefill:], cfgs
    finally:
        for p in pending[len(started):]:
            p.proc.kill()
        for d in started:
            if d.proc.poll() is None:
                d.stop()


def landings(decode: DaemonProcess) -> list[str]:
    """Request ids (attempt ids) that reached Success on this decode, from its log."""
    return [m.group(1) for m in map(_LANDED.search, decode.lines) if m]


def slots_held(decode: DaemonProcess) -> int:
    """Decode's request slots held now, from its Heartbeat."""
    with KvbeamClient(decode.address) as c:
        return c.capacity().slots_held


def figures(d: DaemonProcess) -> dict[str, float]:
    """Per-daemon counts for the N x M tables: handshakes this daemon took part in, peers,
    transport links (one QP each on RDMA), Successes and resident memory."""
    s: Samples = scrape(d.metrics)
    side = "client" if d.role == "prefill" else "server"
    return {"handshakes": value(s, "kvbeam_handshakes_total", side=side, result="ok"),
            "peers": value(s, "kvbeam_peers"),
            "links": value(s, "kvbeam_transport_links"),
            "success": value(s, "kvbeam_transfers_total", state="Success", reason="none"),
            "slots_held": value(s, "kvbeam_slots_reserved"),
            "rss_mib": rss_kib(d.proc.pid) / 1024}
