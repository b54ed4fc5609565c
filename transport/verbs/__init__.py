"""The RDMA data plane over pyverbs: :class:`VerbsTransport` and its links.

Importing this package does not import pyverbs; constructing a transport does.
"""

from kvbeam.transport.verbs.link import VerbsLink
from kvbeam.transport.verbs.linkhost import VerbsHost
from kvbeam.transport.verbs.transport import VerbsTransport

__all__ = ["VerbsHost", "VerbsLink", "VerbsTransport"]
