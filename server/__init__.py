"""The prefill and decode daemons: control plane, lifecycle and the transfer paths.

Control plane (this issue): :class:`kvbeam.server.control.ControlServer` serves
``kvbeam.v1.KvbeamControl`` (:class:`kvbeam.server.servicer.ControlServicer`) and
the gRPC health service; :class:`kvbeam.server.peer_client.ControlClient` is the
client side. A successful handshake yields a
:class:`kvbeam.server.handshake.VerifiedPeer`, which every transfer API requires.

Transfers: each daemon's request state lives in its role's gRPC-free core
(:mod:`kvbeam.server.core`, which also documents the threads and the lock order);
the servicers (:mod:`kvbeam.server.prefill`, :mod:`kvbeam.server.decode`) adapt it
to gRPC.
"""
