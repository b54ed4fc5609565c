"""The protocol version this build speaks.

Two layers of versioning (docs/protocol.md, "Versioning"): the package name
(``kvbeam.v1``) is the major version, a wire-breaking change moves to ``kvbeam.v2``
and an old peer answers UNIMPLEMENTED; :data:`PROTOCOL_VERSION` is exchanged in
every handshake and must be equal on both sides.
"""

from __future__ import annotations

from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb

#: The value sent in ``SideInfo.protocol_version``; the .proto file's
#: ``PROTOCOL_VERSION_CURRENT`` so that the schema and the code cannot disagree.
PROTOCOL_VERSION: int = int(pb.ProtocolVersion.PROTOCOL_VERSION_CURRENT)

#: The fully qualified gRPC service name (also the health-check service name).
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["KvbeamControl"].full_name
