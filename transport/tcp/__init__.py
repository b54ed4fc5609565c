"""The TCP data plane: :class:`TcpTransport` and its links, for hosts without RDMA."""

from kvbeam.transport.tcp.link import TcpLink
from kvbeam.transport.tcp.transport import TcpTransport

__all__ = ["TcpLink", "TcpTransport"]
