"""Render the scaling plots of a ``bench.json`` (from ``bench_suite``) as PNGs, on the host.

    python -m tests.bench.plot_bench .bench/bench.json docs/

Writes ``bench-block-size.png``, ``bench-blocks-per-request.png``,
``bench-concurrency.png``, ``bench-qps.png`` and ``bench-requests.png``: bytes/s
(left axis) and Python CPU time per block (right axis) for each curve; the requests
plot also marks Mooncake TE moving the same requests' blocks, where measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on build machines
import matplotlib.pyplot as plt  # after the backend is chosen


def _curve(ax: Any, ax2: Any, pts: list[dict[str, Any]], label: str, color: str) -> None:
    xs = [p["x"] for p in pts]
    ax.plot(xs, [p["gbps"] for p in pts], "-", marker="o", color=color, label=f"{label} Gb/s")
    ax2.plot(xs, [p["py_us_per_block"] for p in pts], ":", marker="s", color=color, alpha=0.6,
             label=f"{label} Python us/block")


def _figure(path: Path, title: str, xlabel: str, curves: list[tuple[str, list[dict[str, Any]]]],
            ref: float | None, logx: bool = True) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = ["tab:blue", "tab:orange", "tab:green"]
    ax2 = ax.twinx()
    ax2.set_ylabel("Python CPU us per block (squares)")
    for (label, pts), color in zip(curves, colors, strict=False):
        _curve(ax, ax2, pts, label, color)
    if ref:
        ax.axhline(ref, color="grey", linestyle="--", label="ib_write_bw 64 KiB")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Gb/s (circles)")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _peer_points(ax: Any, res: dict[str, Any], ref: float) -> None:
    """Mooncake TE moving the same requests' blocks (one batch call each), where measured."""
    mc = res.get("mooncake_request")
    if not isinstance(mc, dict) or "error" in mc:
        return
    for (style, marker), color in zip([("slot", "*"), ("pages", "P"), ("engine", "X")],
                                      ["black", "tab:purple", "tab:red"], strict=True):
        pts = sorted((int(t), m["bytes"] * 8 / m["median_ms"] / 1e6)
                     for t, m in mc.get(style, {}).items())
        if pts:
            ax.plot([t for t, _ in pts], [g / ref for _, g in pts], marker, color=color,
                    markersize=10, linestyle="none",
                    label=f"Mooncake TE, same blocks ({style} lists)")


def render(res: dict[str, Any], out: Path) -> list[Path]:
    """Every plot the results allow; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    ref = res["limits"]["ib_write_bw"][str(64 << 10)]["gbps"]
    s = res.get("scaling", {})
    files = []
    specs: list[tuple[str, str, str, list[tuple[str, list[dict[str, Any]]]]]] = []
    if "block_size" in s:
        specs.append(("bench-block-size.png", "kvbeam raw writes vs block size (soft-RoCE, TCG)",
                      "block size (bytes)", [("kvbeam", s["block_size"])]))
    if "blocks_per_request" in s:
        specs.append(("bench-blocks-per-request.png",
                      "requests of N 16 KiB pages, planned per request (per page)",
                      "pages per request", list(s["blocks_per_request"].items())))
    if "concurrency" in s:
        specs.append(("bench-concurrency.png", "requests of 16 x 64 KiB blocks in flight",
                      "concurrent requests", [("kvbeam", s["concurrency"])]))
    if "qps_per_peer" in s:
        specs.append(("bench-qps.png", "QPs per peer (one link per QP), 64 KiB blocks",
                      "QPs", [("kvbeam", s["qps_per_peer"])]))
    for name, title, xlabel, curves in specs:
        path = out / name
        _figure(path, title, xlabel, curves, ref)
        files.append(path)
    if res.get("requests"):
        path = out / "bench-requests.png"
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for (mode, integ), style in zip([("unified", True), ("unified", False), ("paged", True),
                                         ("paged", False)], ["o-", "o--", "s-", "s--"],
                                        strict=True):
            rows = [r for r in res["requests"] if r["mode"] == mode and r["integrity"] == integ]
            ax.plot([r["tokens"] for r in rows], [r["gbps"] / ref for r in rows], style,
                    label=f"{mode}, integrity {'on' if integ else 'off'}")
        _peer_points(ax, res, ref)
        ax.axhline(1.0, color="grey", linestyle="--", label="ib_write_bw 64 KiB")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per request")
        ax.set_ylabel("Send->Success bytes/s over ib_write_bw")
        ax.set_ylim(bottom=0)
        ax.set_title("whole DSV4 requests through the daemons", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def main() -> None:
    """Read the JSON, write the PNGs."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json")
    p.add_argument("out", nargs="?", default="docs")
    args = p.parse_args()
    res = json.loads(Path(args.json).read_text())
    for f in render(res, Path(args.out)):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
