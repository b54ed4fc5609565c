"""The target lines of ``make bench`` (issue 14): computed from a ``bench.json``, printed, parsed.

Every figure is a ratio measured in one guest boot (or, for ``host_small_request_ms``,
a time on the host over TCP on loopback). :func:`compute` derives them from the
suite's results; :func:`lines` prints them as ``name=value`` lines (nothing else on
a line, so ``grep``/:func:`parse` read them back); :func:`table` is the
human-readable table with each target beside its figure, printed above the lines.
A figure the run did not produce (a section skipped or failed) is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NAN = float("nan")
K64 = str(64 << 10)
#: Request lengths whose Python CPU per request is reported (tokens).
CPU_LENS = (128, 1024, 8192, 32768)


@dataclass(frozen=True)
class Target:
    """One line: its name, what it measures, and its goal (``at_least`` or at most ``bound``)."""

    name: str
    what: str
    bound: float | None  # None: reported, no goal
    at_least: bool = True
    digits: int = 2

    def goal(self) -> str:
        """The goal as text, e.g. ``>= 0.90``."""
        if self.bound is None:
            return "-"
        return f"{'>=' if self.at_least else '<='} {self.bound:.{self.digits}f}"

    def met(self, value: float) -> bool | None:
        """Whether ``value`` meets the goal (None: no goal, or no figure)."""
        if self.bound is None or math.isnan(value):
            return None
        return value >= self.bound if self.at_least else value <= self.bound


#: In print order. The first two are issue 8's lines, the rest issue 14's.
TARGETS = (
    Target("ratio_vs_mooncake", "raw 64 KiB blocks, kvbeam Gb/s / Mooncake TE Gb/s", 0.95),
    Target("ratio_vs_ib_write_bw", "unified 32k request, integrity on, Send-to-Success "
           "bytes/s / ib_write_bw 64 KiB", 0.90),
    Target("ratio_8k_vs_ib_write_bw", "the same, 8k tokens", 0.75),
    Target("small_request_x_floor", "128-token request / (ib_write_lat 4 KiB + bytes at "
           "ib_write_bw)", 3.0, at_least=False, digits=1),
    Target("integrity_overhead", "unified 32k Send-to-Success, (on - off) / off", 0.10,
           at_least=False),
    Target("ratio_vs_mooncake_request", "Mooncake TE batch time / kvbeam Send-to-Success, "
           "same 32k request's blocks", 0.90),
    Target("ratio_8k_vs_mooncake_request", "the same, 8k tokens", None),
    Target("ratio_vs_mooncake_request_pages", "the same, 32k, pages shuffled (engine lists)",
           None),
    Target("ratio_vs_mooncake_request_engine", "the same, 32k, every kind shuffled", None),
    Target("aggregate_16x8k_vs_ib_write_bw", "16 concurrent 8k requests (drive): total "
           "bytes / wall time / ib_write_bw", 0.90),
    Target("aggregate_16x8k_integrity_off_vs_ib_write_bw", "the same, integrity off", None),
    Target("integrity_61l_rdma_ratio", "61-layer 16k request over RDMA (guest): integrity "
           "on / off, median Send-to-Success", None),
    Target("host_small_request_ms", "host, TCP on loopback: 128-token Send-to-Success, ms",
           None, digits=1),
    *(Target(f"{role}_cpu_ms_per_request_{n}", f"{role} process CPU per {n}-token request "
             "(guest, unified, integrity on), ms", None, digits=1)
      for n in CPU_LENS for role in ("prefill", "decode")),
    *(Target(f"engine_{role}_cpu_ms_128", f"{role} daemon CPU per 128-token request through "
             "the engine channel, as engines run it (guest, RDMA, integrity on), ms", 30.0,
             at_least=False, digits=1) for role in ("prefill", "decode")),
    Target("engine_small_request_ms_guest", "128-token request through the engine channel "
           "(guest, RDMA): prefill engine's send to decode engine's Success, median ms", None,
           digits=1),
)


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is 0 or either is NaN."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else NAN


def floor_ms(res: Mapping[str, Any], nbytes: int) -> float:
    """The latency floor of ``nbytes``: ib_write_lat 4 KiB one-way + the bytes at ib_write_bw."""
    lim = res["limits"]
    ref = lim["ib_write_bw"][K64]["gbps"]
    lat_ms: float = lim["ib_write_lat"][str(4 << 10)]["t_typical_us"] / 1e3
    return lat_ms + ratio(nbytes * 8 / 1e9 * 1e3, ref)


def _row(res: Mapping[str, Any], tokens: int, integrity: bool = True) -> dict[str, Any]:
    """The unified request row of ``tokens`` (empty when absent)."""
    for r in res.get("requests") or []:
        if r["mode"] == "unified" and r["integrity"] is integrity and r["tokens"] == tokens:
            return dict(r)
    return {}


def _mc_ms(res: Mapping[str, Any], style: str, tokens: int) -> float:
    mc = res.get("mooncake_request") or {}
    return float(mc.get(style, {}).get(str(tokens), {}).get("median_ms", NAN))


def _frag_ms(res: Mapping[str, Any], style: str, tokens: int) -> float:
    for r in res.get("fragmented") or []:
        if r["lists"] == style and r["tokens"] == tokens:
            return float(r["median_ms"])
    return NAN


def _integrity_61l_ratio(res: Mapping[str, Any]) -> float:
    rows = (res.get("integrity_61l") or {}).get("rdma") or {}
    if "on" not in rows or "off" not in rows:
        return NAN
    return ratio(rows["on"]["median_ms"], rows["off"]["median_ms"])


def compute(res: Mapping[str, Any]) -> dict[str, float]:
    """Every target figure of a suite result (``bench.json``), NaN where it is missing."""
    ref = res["limits"]["ib_write_bw"][K64]["gbps"]
    raw = (res.get("kvbeam_raw") or {}).get(K64, {}).get("gbps", NAN)
    mc = (res.get("mooncake") or {}).get(K64, {}).get("gbps", NAN)
    on32, on8, on128 = _row(res, 32768), _row(res, 8192), _row(res, 128)
    off32 = _row(res, 32768, integrity=False)
    out = {
        "ratio_vs_mooncake": ratio(raw, mc),
        "ratio_vs_ib_write_bw": ratio(on32.get("gbps", NAN), ref),
        "ratio_8k_vs_ib_write_bw": ratio(on8.get("gbps", NAN), ref),
        "small_request_x_floor": (ratio(on128["median_ms"], floor_ms(res, on128["bytes"]))
                                  if on128 else NAN),
        "integrity_overhead": ratio(on32.get("median_ms", NAN) - off32.get("median_ms", NAN),
                                    off32.get("median_ms", NAN)),
        "ratio_vs_mooncake_request": ratio(_mc_ms(res, "slot", 32768),
                                           on32.get("median_ms", NAN)),
        "ratio_8k_vs_mooncake_request": ratio(_mc_ms(res, "slot", 8192),
                                              on8.get("median_ms", NAN)),
        "ratio_vs_mooncake_request_pages": ratio(_mc_ms(res, "pages", 32768),
                                                 _frag_ms(res, "pages", 32768)),
        "ratio_vs_mooncake_request_engine": ratio(_mc_ms(res, "engine", 32768),
                                                  _frag_ms(res, "engine", 32768)),
        "aggregate_16x8k_vs_ib_write_bw": ratio((res.get("aggregate") or {}).get("gbps", NAN),
                                                ref),
        "aggregate_16x8k_integrity_off_vs_ib_write_bw": ratio(
            (res.get("aggregate_integrity_off") or {}).get("gbps", NAN), ref),
        "integrity_61l_rdma_ratio": _integrity_61l_ratio(res),
        "host_small_request_ms": float((res.get("host_tcp") or {}).get("small_request_ms",
                                                                       NAN)),
    }
    for n in CPU_LENS:
        row = _row(res, n)
        for role in ("prefill", "decode"):
            out[f"{role}_cpu_ms_per_request_{n}"] = float(row.get(f"{role}_cpu_ms", NAN))
    engine = res.get("engine_channel") or {}
    for role in ("prefill", "decode"):
        out[f"engine_{role}_cpu_ms_128"] = float((engine.get("cpu_ms") or {}).get(role, NAN))
    out["engine_small_request_ms_guest"] = float(
        (engine.get("lines") or {}).get("engine_small_request_ms", NAN))
    return out


def lines(values: Mapping[str, float]) -> list[str]:
    """``name=value`` per target, in :data:`TARGETS` order (``nan`` where missing)."""
    return [f"{t.name}={values.get(t.name, NAN):.{t.digits}f}" for t in TARGETS]


def table(values: Mapping[str, float]) -> list[str]:
    """Each target's figure beside its goal and whether it is met (for people)."""
    out = [f"{'line':<44} {'value':>8} {'goal':>8} {'met':>4}  what"]
    for t in TARGETS:
        v = values.get(t.name, NAN)
        met = t.met(v)
        out.append(f"{t.name:<44} {v:>8.{t.digits}f} {t.goal():>8} "
                   f"{'-' if met is None else 'yes' if met else 'NO':>4}  {t.what}")
    return out


def parse(text: Iterable[str] | str) -> dict[str, float]:
    """The target lines in ``text`` (other lines ignored); a name seen twice keeps the last."""
    names = {t.name for t in TARGETS}
    out: dict[str, float] = {}
    for line in text.splitlines() if isinstance(text, str) else text:
        name, sep, value = line.strip().partition("=")
        if sep and name in names:
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out
