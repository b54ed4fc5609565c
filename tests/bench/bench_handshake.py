"""Benchmark: control-plane handshake latency on loopback (host, no RDMA).

Starts a decode control server and handshakes with it from a prefill client:
the first handshake (fresh channel: TCP connect + HTTP/2 setup), then N
handshakes on a reused channel (what a daemon does: one channel per peer), then
N on a fresh channel each, and N empty gRPC calls as the floor. Every handshake
is complete: both sides encode, strictly decode and verify (compare_sides) the
other's metadata. Prints the first, median, p99 and max in milliseconds; the
verdict is on the first handshake and the reused-channel p99.

NIXL's handshake is reported at about 5 s per pair; the target here is < 100 ms.

Run: ``python tests/bench/bench_handshake.py [-n 200]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import PoolSpec, SideConfig, load_side_config
from kvbeam.proto.side import Role, SideInfo, side_to_proto
from kvbeam.server.api.control import ControlServer
from kvbeam.server.peers.client import ControlClient
from kvbeam.transport.endpoint import Endpoint, RemoteRegion

REPO = Path(__file__).resolve().parents[2]
TARGET_MS = 100.0


def _endpoint(n_regions: int) -> Endpoint:
    regions = tuple(RemoteRegion((1 << 40) + i * (1 << 30), 1 << 28, 0x100 + i)
                    for i in range(n_regions))
    return Endpoint("rdma", regions=regions, gid="fe80:0000:0000:0000:0202:c9ff:fe00:0001",
                    qpns=(101, 102, 103, 104), psn=4242, mtu=4096)


def _dsv4_like() -> tuple[SideConfig, SideConfig]:
    """61 layers like DeepSeek-V4 (C4/C128 alternating), NextN draft: a realistic size."""
    target = PoolSpec(compression_ratios=(0, 4, 128) * 20 + (0,), unified_kv=True,
                      sliding_window=128, num_draft_tokens=4, page_size=256, num_req_slots=64,
                      max_context_len=131072, head_dim=512)
    draft = PoolSpec(compression_ratios=(0,), unified_kv=True, sliding_window=128,
                     num_draft_tokens=4, page_size=256, num_req_slots=64,
                     max_context_len=131072, head_dim=512)
    return SideConfig("dsv4-like", target, draft), SideConfig("dsv4-like", target, draft)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _case(name: str, prefill_cfg: SideConfig, decode_cfg: SideConfig, n: int) -> float:
    p_layout, d_layout = build_side_layout(prefill_cfg), build_side_layout(decode_cfg)
    prefill = SideInfo(Role.PREFILL, p_layout, _endpoint(len(p_layout.flat_buffers)))
    decode = SideInfo(Role.DECODE, d_layout, _endpoint(len(d_layout.flat_buffers)))
    size = side_to_proto(prefill).ByteSize()
    server = ControlServer(decode)
    address = server.start("127.0.0.1:0")
    try:
        with ControlClient(address) as client:
            first = _time(lambda: client.handshake(prefill))
            warm = [_time(lambda: client.handshake(prefill)) for _ in range(n)]
            # The floor: an empty gRPC round trip (health Check) on the same channel.
            check = health_pb2_grpc.HealthStub(client.channel).Check
            request = health_pb2.HealthCheckRequest(service="")
            floor = [_time(lambda: check(request, timeout=5)) for _ in range(n)]

        def fresh() -> None:
            with ControlClient(address) as c:
                c.handshake(prefill)

        cold = [_time(fresh) for _ in range(n)]
    finally:
        server.stop(grace=0)
    print(f"{name}: {len(p_layout.flat_buffers)} buffers, SideInfo {size} bytes")
    print(f"  first handshake (new channel)   {first:8.2f} ms")
    for label, times in (("reused channel", warm), ("new channel each", cold),
                         ("(empty gRPC call)", floor)):
        print(f"  {label:<17} n={n:<4} median {statistics.median(times):6.2f} ms   "
              f"p99 {_percentile(times, 0.99):6.2f} ms   max {max(times):6.2f} ms")
    # A daemon keeps one channel per peer: a pair pays the first handshake once,
    # then the reused-channel latency. The new-channel series is for information.
    return max(first, _percentile(warm, 0.99))


def main() -> None:
    """Print the figures for the shipped tiny configs and a 61-layer DSV4-like layout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200, help="handshakes per series (default 200)")
    args = parser.parse_args()
    configs = REPO / "docker/config"
    worst = max(
        _case("dsv4-tiny (docker/config)", load_side_config(configs / "prefill.yaml"),
              load_side_config(configs / "decode.yaml"), args.n),
        _case("dsv4-like, 61 layers", *_dsv4_like(), args.n),
    )
    verdict = "OK" if worst < TARGET_MS else "OVER TARGET"
    print(f"worst of first handshake / reused-channel p99: {worst:.2f} ms "
          f"(target < {TARGET_MS:.0f} ms): {verdict}")


if __name__ == "__main__":
    main()
