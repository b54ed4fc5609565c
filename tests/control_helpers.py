"""Shared helpers for the control-plane tests: sides, endpoints, servers, raw calls, free
ports and the ``kvbeam`` CLI as a process."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import grpc

from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import PoolSpec, SideConfig
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.rejection_codec import (
    BUDGET_KEY,
    MAX_REJECTION_BYTES,
    Rejection,
    decode_rejection,
)
from kvbeam.proto.rejection_codec import find_rejection as _find
from kvbeam.proto.service import control_stub
from kvbeam.proto.side import Role, SideInfo
from kvbeam.server.api.control import ControlServer
from kvbeam.server.api.servicer import ControlServicer
from kvbeam.server.settings import add_daemon_arguments
from kvbeam.transport.endpoint import Endpoint, RemoteRegion
from tests import fixtures
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, REPO, UNIFIED_DRAFT, UNIFIED_TARGET

# C128 layers too, so the C128_STATE component exists; decode has more request
# slots than prefill (capacity is per side and must not matter).
U_TARGET = replace(UNIFIED_TARGET, compression_ratios=(0, 4, 128, 0))
U_DRAFT = UNIFIED_DRAFT
P_TARGET = replace(PAGED_TARGET, compression_ratios=(0, 4, 128, 0))
P_DRAFT = PAGED_DRAFT
DECODE_SLOTS = 6


def tcp_endpoint(port: int = 9000) -> Endpoint:
    """A plausible TCP data-plane endpoint."""
    return Endpoint("tcp", regions=(RemoteRegion(0x7F00_0000_0000, 1 << 20),),
                    address=f"127.0.0.1:{port}")


def rdma_endpoint() -> Endpoint:
    """A plausible RDMA endpoint (values as pyverbs would report them)."""
    return Endpoint("rdma", regions=(RemoteRegion(0x7F00_0000_0000, 1 << 20, 0x1234),
                                     RemoteRegion(0x7F00_1000_0000, 4096, 0x5678)),
                    gid="fe80:0000:0000:0000:0202:c9ff:fe00:0001", qpns=(17, 18), psn=0xABCDE,
                    mtu=1024, extra={"port": "1"})


def config(paged: bool = False, *, draft: bool = True, **target_changes: Any) -> SideConfig:
    """A side config (unified by default), target fields optionally changed."""
    d: PoolSpec | None = (P_DRAFT if paged else U_DRAFT) if draft else None
    return fixtures.side(P_TARGET if paged else U_TARGET, d, **target_changes)


def draft_changed(cfg: SideConfig, **changes: Any) -> SideConfig:
    """The same config with draft fields changed (a within-side mismatch when they matter)."""
    assert cfg.draft is not None
    return replace(cfg, draft=replace(cfg.draft, **changes))


def with_slots(cfg: SideConfig, slots: int) -> SideConfig:
    """The same config with ``slots`` request slots in both pools (a per-side capacity)."""
    draft = replace(cfg.draft, num_req_slots=slots) if cfg.draft else None
    return replace(cfg, target=replace(cfg.target, num_req_slots=slots), draft=draft)


def side(role: Role, cfg: SideConfig, endpoint: Endpoint | None = None, **kw: Any) -> SideInfo:
    """A SideInfo for ``cfg`` (decode gets more slots unless told otherwise)."""
    return SideInfo(role=role, layout=build_side_layout(cfg), endpoint=endpoint or tcp_endpoint(),
                    **kw)


@contextmanager
def running(local: SideInfo, *, servicer: ControlServicer | None = None,
            startup_check: bool = False) -> Iterator[ControlServer]:
    """A started ControlServer on a free loopback port; stopped afterwards."""
    server = ControlServer(local, servicer=servicer, startup_check=startup_check)
    server.start("127.0.0.1:0")
    try:
        yield server
    finally:
        server.stop(grace=0)


def raw_handshake(address: str, request: pb.HandshakeRequest, *, timeout: float = 5.0,
                  budget: int | None = MAX_REJECTION_BYTES,
                  ) -> tuple[grpc.StatusCode, pb.HandshakeResponse | None, Rejection | None, str]:
    """Call Handshake directly: (status code, reply, decoded rejection trailer, details)."""
    options = [("grpc.max_metadata_size", 4 << 20), ("grpc.absolute_max_metadata_size", 4 << 20)]
    metadata = ((BUDGET_KEY, str(budget)),) if budget is not None else None
    with grpc.insecure_channel(address, options=options) as channel:
        try:
            reply = control_stub(channel).Handshake(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raw = _find(exc.trailing_metadata())
            rejection = decode_rejection(raw) if raw is not None else None
            return exc.code(), None, rejection, exc.details() or ""
    return grpc.StatusCode.OK, reply, None, ""


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_cli(*argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``python -m kvbeam.cli ARGV`` in a fresh process from the repository root; never raises
    for its exit code (check ``returncode``)."""
    return subprocess.run([sys.executable, "-m", "kvbeam.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, check=False)


def daemon_args(*argv: str) -> argparse.Namespace:
    """A daemon command line parsed as ``kvbeam prefill|decode`` parses it (for ``resolve``)."""
    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    return parser.parse_args(argv)
