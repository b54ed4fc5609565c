"""The one error <-> gRPC status mapping (kvbeam.rpc_errors), both directions, and its docs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

import kvbeam.errors as errors
from kvbeam.rpc_errors import code_for, handled, request_error

REPO = Path(__file__).resolve().parents[2]
Code = grpc.StatusCode


class FakeRpcError(grpc.RpcError):
    """What a stub raises for a failed call: a status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Aborted(Exception):
    """context.abort raises; this stands in for gRPC's own exception."""


class FakeContext:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise Aborted(details)


# What a handler's error becomes on the wire, and what the public client makes of it.
ROUND_TRIP: list[tuple[errors.KvbeamError, grpc.StatusCode, type[errors.KvbeamError]]] = [
    (errors.DuplicateRequest("r"), Code.ALREADY_EXISTS, errors.DuplicateRequest),
    (errors.TooManyTransfers("full"), Code.RESOURCE_EXHAUSTED, errors.Busy),
    (errors.NoFreeSlot("none"), Code.RESOURCE_EXHAUSTED, errors.Busy),
    (errors.UnknownRequest("r"), Code.NOT_FOUND, errors.UnknownRequest),
    (errors.NotHandshakenError("p"), Code.FAILED_PRECONDITION, errors.BadRequest),
    (errors.IllegalTransition("s"), Code.FAILED_PRECONDITION, errors.BadRequest),
    (errors.BadRequest("b"), Code.INVALID_ARGUMENT, errors.BadRequest),
    (errors.PlanError("p"), Code.INVALID_ARGUMENT, errors.BadRequest),
    (errors.ProtocolError("f", "bad"), Code.INVALID_ARGUMENT, errors.BadRequest),
    (errors.ProtocolVersionError(1, 2), Code.INVALID_ARGUMENT, errors.BadRequest),
    (errors.ConfigError("c"), Code.INVALID_ARGUMENT, errors.BadRequest),
    (errors.PeerTimeoutError("t"), Code.UNAVAILABLE, errors.PeerUnavailableError),
    (errors.TransportError("t"), Code.INTERNAL, errors.PeerError),
]


@pytest.mark.parametrize(("exc", "code", "client_kind"), ROUND_TRIP,
                         ids=[type(e).__name__ for e, _, _ in ROUND_TRIP])
def test_server_status_and_client_error(exc: errors.KvbeamError, code: grpc.StatusCode,
                                        client_kind: type[errors.KvbeamError]) -> None:
    assert code_for(exc) is code
    back = request_error(FakeRpcError(code, f"{type(exc).__name__}: {exc}"),
                         address="127.0.0.1:1", method="Send", timeout=1.0)
    assert type(back) is client_kind
    assert str(back).startswith("Send ")
    assert type(exc).__name__ in str(back)


@pytest.mark.parametrize(("code", "kind"), [
    (Code.DEADLINE_EXCEEDED, errors.PeerTimeoutError),
    (Code.UNAUTHENTICATED, errors.AuthenticationError),
    (Code.UNIMPLEMENTED, errors.NotKvbeamPeerError),
    (Code.UNAVAILABLE, errors.PeerUnavailableError),
])
def test_transport_level_failures_are_peer_errors(code: grpc.StatusCode,
                                                  kind: type[errors.PeerError]) -> None:
    back = request_error(FakeRpcError(code, "details"), address="h:1", method="Status",
                         timeout=2.0)
    assert type(back) is kind
    assert isinstance(back, errors.PeerError)
    assert back.address == "h:1" and back.code == code.name


class Servicer:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.refused: list[tuple[str, grpc.StatusCode]] = []

    def on_refused(self, method: str, code: grpc.StatusCode) -> None:
        self.refused.append((method, code))

    @handled
    def Reserve(self, request: Any, context: Any) -> None:
        raise self.exc


@pytest.mark.parametrize(("exc", "code"), [
    (errors.NoFreeSlot("no free request slot: all 4 are held"), Code.RESOURCE_EXHAUSTED),
    (RuntimeError("a bug"), Code.INTERNAL),
])
def test_handled_answers_with_the_mapped_status(exc: Exception, code: grpc.StatusCode) -> None:
    servicer, context = Servicer(exc), FakeContext()
    with pytest.raises(Aborted):
        servicer.Reserve(object(), context)
    assert context.status == (code, f"{type(exc).__name__}: {exc}")
    assert servicer.refused == [("Reserve", code)]


def test_docs_list_every_error_class() -> None:
    text = (REPO / "docs/errors.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)`", text, re.M))
    defined = {n for n, v in vars(errors).items()
               if inspect.isclass(v) and issubclass(v, BaseException)
               and v.__module__ == "kvbeam.errors"}
    assert documented == defined
