"""The prefill and decode daemons: control plane, lifecycle and the transfer paths.

Control plane (this issue): :class:`kvbeam.server.api.control.ControlServer` serves
``kvbeam.v1.KvbeamControl`` (:class:`kvbeam.server.api.servicer.ControlServicer`) and
the gRPC health service; :class:`kvbeam.server.peers.client.ControlClient` is the
client side. A successful handshake yields a
:class:`kvbeam.server.state.handshake.VerifiedPeer`, which every transfer API requires.

Transfers: each daemon's request state lives in its role's gRPC-free core
(:mod:`kvbeam.server.core`, which also documents the threads and the lock order);
the servicers (:mod:`kvbeam.server.api.prefill`, :mod:`kvbeam.server.api.decode`) adapt it
to gRPC.
"""
