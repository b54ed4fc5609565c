"""Errors of the wire protocol: a message that is malformed, inconsistent or of another version."""

from __future__ import annotations

from kvbeam.errors import KvbeamError


class ProtocolError(KvbeamError):
    """A protobuf message that kvbeam refuses to decode (or a value it cannot encode).

    ``field`` is the dotted path of the offending field, e.g.
    ``side.metadata.components[2].buffers[0].item_len``; ``problem`` says what is
    wrong with it. ``origin`` (optional) says where the message came from.
    """

    def __init__(self, field: str, problem: str, *, origin: str = "") -> None:
        self.field = field
        self.problem = problem
        self.origin = origin
        prefix = f"{origin}: " if origin else ""
        super().__init__(f"{prefix}{field}: {problem}")

    def from_origin(self, origin: str) -> ProtocolError:
        """The same error, saying where the message came from (e.g. the peer's address)."""
        return ProtocolError(self.field, self.problem, origin=origin)


class ProtocolVersionError(ProtocolError):
    """The peer speaks another kvbeam protocol version than this side."""

    def __init__(self, local: int, remote: int, *, field: str = "protocol_version",
                 origin: str = "") -> None:
        self.local = local
        self.remote = remote
        super().__init__(
            field,
            f"protocol version mismatch: this side speaks kvbeam protocol version {local}, "
            f"the peer speaks {remote}; run the same kvbeam protocol version on both sides",
            origin=origin,
        )

    def from_origin(self, origin: str) -> ProtocolVersionError:
        """The same error, saying where the message came from."""
        return ProtocolVersionError(self.local, self.remote, field=self.field, origin=origin)
