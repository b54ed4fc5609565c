"""Compatibility alias: :class:`ControlOptions` lives in :mod:`kvbeam.server.settings`.

Kept only because ``kvbeam.server.client`` (owned by another change) still imports it
from here; delete once that import names :mod:`kvbeam.server.settings`.
"""

from kvbeam.server.settings import (
    DEFAULT_RPC_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    MAX_METADATA_BYTES,
    ControlOptions,
)

__all__ = ["DEFAULT_RPC_TIMEOUT_S", "MAX_MESSAGE_BYTES", "MAX_METADATA_BYTES", "ControlOptions"]
