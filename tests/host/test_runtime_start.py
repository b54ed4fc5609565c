"""A daemon's side (its advertised control address) is fixed before its server serves.

A daemon bound to a wildcard address without ``--advertise`` advertises
``hostname:port``. That address must be in the side the servicer sends before the
first handshake can arrive: replacing ``servicer.local`` after the server started
races with handshakes already being answered with the old (empty) address.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbeam.proto.side import SideInfo
from kvbeam.server.api.decode import DecodeServicer
from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import resolve
from kvbeam.transport.tcp import TcpLink, TcpTransport
from tests.fixtures import shipped_config


class RecordingServicer(DecodeServicer):
    """Records, for every change of ``local``, whether the control server was serving."""

    def __init__(self, runtime: Runtime) -> None:
        self.changes: list[tuple[bool, str]] = []
        super().__init__(runtime)

    @property
    def local(self) -> SideInfo:
        return super().local

    @local.setter
    def local(self, side: SideInfo) -> None:
        rt: Any = getattr(self, "rt", None)
        server = rt.server if rt is not None else None
        serving = server is not None and server._server is not None
        self.changes.append((serving, side.control_address))
        DecodeServicer.local.fset(self, side)  # type: ignore[attr-defined]


def test_wildcard_listen_fixes_the_advertised_address_before_serving() -> None:
    env = {"KVBEAM_CONFIG": shipped_config("decode"), "KVBEAM_LISTEN": "0.0.0.0:0",
           "KVBEAM_INSECURE": "true", "KVBEAM_TRANSPORT": "tcp"}
    runtime = Runtime(resolve("decode", None, env))
    servicer = RecordingServicer(runtime)
    try:
        address = runtime.start(servicer)
        port = address.rpartition(":")[2]
        advertised = servicer.local.control_address
        assert advertised.endswith(f":{port}") and not advertised.startswith("0.0.0.0")
        late = [c for c in servicer.changes if c[0]]
        assert not late, f"servicer.local replaced while serving: {late}"
        assert runtime.local.control_address == advertised
    finally:
        runtime.stop(grace=0.2)


def test_start_up_creates_no_throwaway_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """The side's endpoint before any peer is a template of the transport's kind: no link
    (over RDMA: no QP, no memory keys) is created and thrown away for it."""
    created: list[object] = []
    real = TcpTransport.create_link

    def counting(self: TcpTransport) -> TcpLink:
        created.append(self)
        return real(self)

    monkeypatch.setattr(TcpTransport, "create_link", counting)
    env = {"KVBEAM_CONFIG": shipped_config("decode"), "KVBEAM_LISTEN": "127.0.0.1:0",
           "KVBEAM_TRANSPORT": "tcp"}
    runtime = Runtime(resolve("decode", None, env))
    try:
        servicer = DecodeServicer(runtime)
        servicer.prepare()  # the template encodes and validates as the side's endpoint
        assert runtime.local.endpoint.kind == "tcp"
        assert created == []
    finally:
        runtime.transport.close()
