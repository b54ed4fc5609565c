"""Plain data the cores keep and everything reads: the transfer table (lifecycle and
deadlines), the verified peers and their connections, decode's request slots, and the
handshake that turns a peer's description into a verified peer."""
