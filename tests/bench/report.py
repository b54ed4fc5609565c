"""The table ``bench_suite`` prints for a ``bench.json`` (also ``bench_suite --report``).

Sections: limits and raw blocks, whole requests (with each daemon's CPU per
request), the Mooncake whole-request peer, engine-chosen lists, 16 concurrent
requests, the host figures, scaling, the profile; then the targets table
(:func:`tests.bench.targets.table`) and, last, the machine-readable
``name=value`` lines (:func:`tests.bench.targets.lines`).
"""

from __future__ import annotations

from typing import Any

from tests.bench import targets
from tests.bench.bench_transport import print_poster_rates
from tests.bench.targets import K64, NAN, floor_ms, ratio

SIZES = [4 << 10, 64 << 10, 1 << 20]


def _raw(res: dict[str, Any]) -> None:
    bw, lat = res["limits"]["ib_write_bw"], res["limits"]["ib_write_lat"]
    mc, raw = res.get("mooncake") or {}, res.get("kvbeam_raw") or {}
    print(f"\n== limits and raw blocks on {res['device']} (median of {res['repeat']}; "
          "ratios to ib_write_bw of the same size, same boot)")
    print(f"{'block':>8} {'ib_write_bw':>11} {'lat us':>7} {'mooncake':>9} {'mc/ib':>6} "
          f"{'kvbeam':>8} {'kv/ib':>6} {'kv/mc':>6} {'py us/blk':>9} {'crc':>7}")
    for size in SIZES:
        k = str(size)
        ref = bw[k]["gbps"]
        m = mc.get(k, {}).get("gbps", NAN)
        rk = raw.get(k, {})
        r = rk.get("gbps", NAN)
        crc = ("ok" if rk.get("crc_ok", False) and mc.get(k, {}).get("crc_ok", True) else "BAD")
        print(f"{size >> 10:>6}Ki {ref:>11.3f} {lat[k]['t_typical_us']:>7.1f} {m:>9.3f} "
              f"{ratio(m, ref):>6.2f} {r:>8.3f} {ratio(r, ref):>6.2f} {ratio(r, m):>6.2f} "
              f"{rk.get('py_us_per_block', NAN):>9.2f} {crc:>7}")
    for sec in ("mooncake", "mooncake_request", "kvbeam_raw", "scaling"):
        if isinstance(res.get(sec), dict) and "error" in res[sec]:
            print(f"{sec}: FAILED: {res[sec]['error']}")
    for sec in ("requests_error", "fragmented_error"):
        if res.get(sec):
            print(f"{sec.split('_')[0]}: FAILED: {res[sec]}")
    print("(Gb/s; lat us = ib_write_lat typical one-way latency)")


def _requests(res: dict[str, Any]) -> None:
    ref64 = res["limits"]["ib_write_bw"][K64]["gbps"]
    print(f"\n== whole DSV4 requests, Send -> Success (median of {res['req_repeat']}); "
          f"reference ib_write_bw 64 KiB {ref64:.3f} Gb/s")
    print(f"{'mode':>8} {'integ':>5} {'tokens':>7} {'bytes':>9} {'ms':>8} {'Gb/s':>7} "
          f"{'/ib_bw':>6} {'floor ms':>8} {'x floor':>7} {'cpu P ms':>8} {'cpu D ms':>8} "
          f"{'idle P/D':>11}")
    for r in res["requests"]:
        floor = floor_ms(res, r["bytes"])
        print(f"{r['mode']:>8} {'on' if r['integrity'] else 'off':>5} {r['tokens']:>7} "
              f"{r['bytes']:>9} {r['median_ms']:>8.1f} {r['gbps']:>7.3f} "
              f"{ratio(r['gbps'], ref64):>6.2f} {floor:>8.1f} {r['median_ms'] / floor:>7.1f} "
              f"{r.get('prefill_cpu_ms', NAN):>8.1f} {r.get('decode_cpu_ms', NAN):>8.1f} "
              f"{r.get('prefill_idle_ms', NAN):>5.1f}/{r.get('decode_idle_ms', NAN):<5.1f}")
    print("(floor = ib_write_lat 4 KiB one-way latency + bytes at ib_write_bw 64 KiB; cpu P/D = "
          "prefill's/decode's process CPU per request, all threads; idle P/D = of that, what "
          "each burns idle in the same time)")


def _peer(res: dict[str, Any]) -> None:
    mc = res.get("mooncake_request")
    frag = {(r["lists"], r["tokens"]): r for r in res.get("fragmented") or []}
    if not isinstance(mc, dict) or "error" in mc or not mc:
        return
    kv = {r["tokens"]: r for r in res["requests"]
          if r["mode"] == "unified" and r["integrity"]}
    print("\n== the same request's blocks: Mooncake TE, one batch_transfer_sync_write, "
          "vs kvbeam Send -> Success (unified, integrity on)")
    print(f"{'lists':>7} {'tokens':>7} {'blocks':>7} {'bytes':>9} {'mooncake ms':>11} "
          f"{'kvbeam ms':>9} {'mc/kv':>6} {'crc':>4}")
    for style, per_len in mc.items():
        for tokens, m in per_len.items():
            k = (kv.get(int(tokens), {}) if style == "slot"
                 else frag.get((style, int(tokens)), {}))
            kv_ms = k.get("median_ms", NAN)
            print(f"{style:>7} {tokens:>7} {m['blocks']:>7} {m['bytes']:>9} "
                  f"{m['median_ms']:>11.1f} {kv_ms:>9.1f} {ratio(m['median_ms'], kv_ms):>6.2f} "
                  f"{'ok' if m['crc_ok'] else 'BAD':>4}")


def _concurrent_and_host(res: dict[str, Any]) -> None:
    ref64 = res["limits"]["ib_write_bw"][K64]["gbps"]
    for key, integrity in (("aggregate", "on"), ("aggregate_integrity_off", "off")):
        agg = res.get(key)
        if not isinstance(agg, dict):
            continue
        head = (f"\n== {agg.get('concurrency', 16)} concurrent {agg.get('tokens', 8192)}-token "
                f"requests (drive), unified, integrity {integrity}:")
        if "gbps" in agg:
            print(f"{head} {agg['gbps']:.3f} Gb/s = {ratio(agg['gbps'], ref64):.2f} x "
                  f"ib_write_bw (rounds: {', '.join(f'{g:.3f}' for g in agg['runs_gbps'])})")
        else:
            print(f"{head} FAILED: {agg.get('error')}")
            for state in sorted(set(agg.get("failures", [])))[:4]:
                print(f"  {state[:200]}")
    host = res.get("host_tcp")
    if isinstance(host, dict) and "requests" in host:
        print(f"\n== host {host.get('host', '')} {host.get('started', '')}: TCP on loopback, "
              "unified, integrity on")
        for r in host["requests"]:
            print(f"{r['tokens']:>7} tokens {r['median_ms']:>7.1f} ms Send -> Success, CPU per "
                  f"request prefill {r['prefill_cpu_ms']:.1f} ms, decode "
                  f"{r['decode_cpu_ms']:.1f} ms")


def _scaling(res: dict[str, Any]) -> None:
    s = res.get("scaling") or {}
    for name in ("block_size", "concurrency", "qps_per_peer"):
        if isinstance(s.get(name), list):
            print(f"\n== scaling: {name}")
            for p in s[name]:
                print(f"{p['label']:>14} {p['gbps']:>7.3f} Gb/s {p['blocks_per_s']:>9.0f} blk/s "
                      f"py {p['py_us_per_block']:>7.2f} us/blk post {p['post_us_per_block']:>8.1f}"
                      " us/blk")
    for mode, pts in (s.get("blocks_per_request") or {}).items():
        print(f"\n== scaling: blocks per request ({mode}; 16 KiB pages; per page)")
        for p in pts:
            print(f"{int(p['x']):>8} pages {p['gbps']:>7.3f} Gb/s {p['requests_per_s']:>7.1f} "
                  f"req/s py {p['py_us_per_block']:>7.2f} us/page (plan "
                  f"{p['plan_us_per_block']:.2f})")
    prof = res.get("profile_128")
    if isinstance(prof, dict) and "info" in prof:
        print(f"\n== profile: {prof['info']}; Python CPU ms per request (GIL held) by phase")
        for daemon in ("prefill", "decode"):
            phases = ", ".join(f"{k} {v:.1f}" for k, v in prof[daemon].items())
            print(f"{daemon} ({sum(prof[daemon].values()):.1f} ms): {phases}")


def _threads(res: dict[str, Any]) -> None:
    for tokens, per in (res.get("threads") or {}).items():
        if not isinstance(per, dict) or "prefill" not in per:
            continue
        print(f"\n== CPU ms per {tokens}-token request by thread group (unified, integrity on; "
              f"median Send -> Success {per['send_to_success_ms']['median']:.1f} ms)")
        for daemon in ("prefill", "decode"):
            groups = ", ".join(f"{k} {v:.1f}" for k, v in per[daemon].items() if k != "total")
            print(f"{daemon} ({per[daemon]['total']:.1f} ms): {groups}")


def _integrity_61l(res: dict[str, Any]) -> None:
    sec = res.get("integrity_61l")
    if isinstance(sec, dict) and "error" in sec:
        print(f"\n== integrity_61l: FAILED: {sec['error']}")
    elif isinstance(sec, dict):
        from tests.bench.bench_digest import print_daemon_figures

        lib = sec["library"]
        wall, cpu = lib["request_ms"]["inline"]
        print(f"\n== 61-layer request ({lib['request_buffers']} buffers, "
              f"{lib['request_bytes'] / 1e6:.1f} MB): one thread digests it in {wall:.0f} ms "
              f"({cpu:.0f} ms CPU)")
        print_daemon_figures(sec["rdma"], "rdma", lib["memcpy_ms"][0])


def _posters(res: dict[str, Any]) -> None:
    rates = res.get("posters")
    if isinstance(rates, dict) and "error" in rates:
        print(f"posters: FAILED: {rates['error']}")
    elif isinstance(rates, dict):
        print_poster_rates(rates)


def report(res: dict[str, Any]) -> None:
    """The table on stdout; the targets table; last, one ``name=value`` line per target."""
    _raw(res)
    _posters(res)
    _requests(res)
    _peer(res)
    _concurrent_and_host(res)
    _scaling(res)
    _threads(res)
    _integrity_61l(res)
    values = targets.compute(res)
    print("\n== targets (issue 14; one boot; host_small_request_ms on the host)")
    print("\n".join(targets.table(values)))
    print("\n".join(targets.lines(values)))
