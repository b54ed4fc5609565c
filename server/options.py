"""Control-plane settings shared by the server and the client."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbeam.auth import Security

#: Default deadline of every control RPC, seconds (the daemons' KVBEAM_RPC_TIMEOUT_S
#: default too). A handshake takes milliseconds; the margin covers a loaded host.
DEFAULT_RPC_TIMEOUT_S = 5.0
#: Largest message either side accepts (a 61-layer DSV4 SideInfo is ~20 KB).
MAX_MESSAGE_BYTES = 16 << 20
#: Largest header/trailer block accepted. The rejection trailer carries the
#: server's metadata and every difference; gRPC's 8 KiB default is too small.
MAX_METADATA_BYTES = 4 << 20


@dataclass(frozen=True)
class ControlOptions:
    """Settings of a control server or client.

    Attributes:
        rpc_timeout_s: deadline of each client RPC (handshake included).
        max_workers: server handler threads (streaming WatchStatus holds one each).
        max_message_bytes: largest request/reply accepted and sent.
        max_metadata_bytes: largest header/trailer block accepted.
        security: how the server authenticates callers and channels authenticate
            themselves (default: none, loopback only).
    """

    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
    max_workers: int = 16
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_metadata_bytes: int = MAX_METADATA_BYTES
    security: Security = field(default_factory=Security)

    def __post_init__(self) -> None:
        if not self.rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {self.rpc_timeout_s}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.max_message_bytes < 1 << 16 or self.max_metadata_bytes < 1 << 16:
            raise ValueError("max_message_bytes and max_metadata_bytes must be >= 64 KiB")

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server arguments implementing these settings."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", self.max_metadata_bytes),
        ]
