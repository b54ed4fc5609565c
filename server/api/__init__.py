"""The daemon's adapters for schedulers, operators and peers' RPCs: the gRPC control
server, the servicers (what both roles serve alike, and each role's own RPCs and peer
channel requests) and the handshake's server side."""
