"""The prefill and decode daemons: control plane, lifecycle and the transfer paths.

Control plane (this issue): :class:`kvbeam.server.control.ControlServer` serves
``kvbeam.v1.KvbeamControl`` (:class:`kvbeam.server.servicer.ControlServicer`) and
the gRPC health service; :class:`kvbeam.server.peer_client.ControlClient` is the
client side. A successful handshake yields a
:class:`kvbeam.server.handshake.VerifiedPeer`, which every transfer API requires.
"""
