"""Many prefill and decode daemons at once: the fleet and N x M tests (host and guest)."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess, PendingDaemon
from kvbeam.scheduler import RequestResult, run_request
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
               extra: Sequence[str] = (), env: dict[str, str] | None = None) -> PendingDaemon:
    """One daemon of the fleet, serving metrics on a free port (``env``: fault hooks)."""
    return spawn(role, transport=transport, cfg=cfg, listen=listen,
                 extra=["--metrics", "127.0.0.1:0", *extra], env=env)


@contextmanager
def fleet(n_prefill: int, n_decode: int, folder: Path, *, transport: str = "tcp",
          slots: int = 4, max_context: int = 4096, extra: Sequence[str] = (),
          startup_s: float = STARTUP_S, prefill_env: dict[str, str] | None = None,
          prefill_extra: Sequence[str] = ()
          ) -> Iterator[tuple[list[DaemonProcess], list[DaemonProcess], dict[str, str]]]:
    """``n_prefill`` prefills and ``n_decode`` decodes, all started at once (start-ups
    overlap; ``startup_s`` is for all of them together); yields (prefills, decodes,
    {"prefill": cfg, "decode": cfg}); all stopped after. ``prefill_env`` and
    ``prefill_extra``: the prefills' extra environment and flags (fault hooks, e.g. a
    slow wire, need ``--enable-fault-injection``)."""
    cfgs = {role: small_config(role, folder, slots=slots, max_context=max_context)
            for role in ("prefill", "decode")}
    pending = [spawn_role("prefill", cfgs["prefill"], transport=transport,
                          extra=[*extra, *prefill_extra], env=prefill_env)
               for _ in range(n_prefill)]
    pending += [spawn_role("decode", cfgs["decode"], transport=transport, extra=extra)
                for _ in range(n_decode)]
    started: list[DaemonProcess] = []
    try:
        for p in pending:
            started.append(p.ready(startup_s))
        yield started[:n_prefill], started[n_prefill:], cfgs
    finally:
        stop_all([p.proc for p in pending])


def stop_all(procs: Sequence[subprocess.Popen[str]], timeout: float = 15.0) -> None:
    """SIGTERM every daemon first, then wait for each (their shutdowns overlap); SIGKILL any
    still running after ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    end = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


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


@dataclass
class NxM:
    """What one N x M run measured: per round wall time and bytes, per daemon figures."""

    rounds: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)
    figures: list[dict[str, dict[str, float]]] = field(default_factory=list)  # per round

    def bytes_per_s(self, round_index: int = -1) -> float:
        """Aggregate bytes/s of one round (the last: warm, no handshake in it)."""
        seconds, nbytes = self.rounds[round_index]
        return nbytes / seconds


def every_pair(prefills: Sequence[DaemonProcess], decodes: Sequence[DaemonProcess], *,
               seq_len: int, rounds: int = 2, source_slots: int = 4,
               timeout: float = 60.0, after_round: Callable[[], None] | None = None) -> NxM:
    """One request per (prefill, decode) pair per round, ``len(prefills)`` at a time in
    diagonal order (each wave spreads over every daemon); figures after each round (and
    ``after_round`` called). Every request must reach Success."""
    out = NxM()
    pcs = [KvbeamClient(p.address) for p in prefills]
    dcs = [KvbeamClient(d.address) for d in decodes]
    n, m = len(prefills), len(decodes)
    order = [(i, (i + r) % m) for r in range(m) for i in range(n)]
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            for k in range(rounds):
                def one(pair: tuple[int, int], k: int = k) -> RequestResult:
                    i, j = pair
                    return run_request(pcs[i], dcs[j], f"nxm-{k}-{i}-{j}", seq_len,
                                       j % source_slots, timeout=timeout)

                t0 = time.monotonic()
                results = list(pool.map(one, order))
                elapsed = time.monotonic() - t0
                bad = [r for r in results if not r.ok]
                assert not bad, bad[:5]
                out.rounds.append((elapsed, sum(r.bytes for r in results)))
                out.figures.append({d.address: figures(d) for d in [*prefills, *decodes]})
                if after_round is not None:
                    after_round()
    finally:
        for c in [*pcs, *dcs]:
            c.close()
    return out


def assert_per_peer_not_per_request(run: NxM, prefills: Sequence[DaemonProcess],
                                    decodes: Sequence[DaemonProcess]) -> None:
    """One handshake and one link per pair, made in the first round and reused after it:
    each daemon's counts equal its number of peers, and later rounds add none."""
    first, last = run.figures[0], run.figures[-1]
    for d in [*prefills, *decodes]:
        peers = len(decodes) if d.role == "prefill" else len(prefills)
        for key in ("handshakes", "peers", "links"):
            assert first[d.address][key] == peers, (d.role, d.address, key, first[d.address])
            assert last[d.address][key] == peers, (d.role, d.address, key, last[d.address])


def table(run: NxM, prefills: Sequence[DaemonProcess], decodes: Sequence[DaemonProcess],
          extra: dict[str, dict[str, int]] | None = None) -> str:
    """Per-role min/max of each per-daemon figure after the last round, and round times."""
    last = run.figures[-1]
    lines = [f"N x M = {len(prefills)} x {len(decodes)}, pairs {len(prefills) * len(decodes)}"]
    for role, group in (("prefill", prefills), ("decode", decodes)):
        rows = [dict(last[d.address], **(extra or {}).get(d.address, {})) for d in group]
        cells = []
        for key in rows[0]:
            vals = [r[key] for r in rows]
            cells.append(f"{key} {min(vals):.0f}..{max(vals):.0f}")
        lines.append(f"  {role:<7} per daemon: " + ", ".join(cells))
    for k, (seconds, nbytes) in enumerate(run.rounds):
        lines.append(f"  round {k + 1}: {nbytes / 1e6:.1f} MB in {seconds:.2f} s = "
                     f"{nbytes / seconds / 1e6:.1f} MB/s aggregate")
    return "\n".join(lines)
