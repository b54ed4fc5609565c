"""The daemon's side of the other daemons: the handshake client, the peer channel's
sockets (one per pair) and the calls the cores make over it, and the peer identity
that authentication binds."""
