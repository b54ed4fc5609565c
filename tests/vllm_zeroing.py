"""The negative control of tests/host/test_vllm_connector.py, inside the test harness only.

:class:`ZeroingConnector` is the kvbeam connector with one difference: once a transfer
whose kvbeam id starts with :data:`ZERO_PREFIX` landed, its worker zeroes the request's
first block in every layer (before releasing the reservation, as vLLM takes the KV
over). The decode instance of the test loads it with ``kv_connector_module_path``
``tests.vllm_zeroing``; nothing in kvbeam names this module, so no request parameter,
setting or variable of a production deployment can turn the zeroing on.
"""

from __future__ import annotations

import logging
from typing import Any

from kvbeam.engine import Receiver
from kvbeam.integrations.vllm.connector import KvbeamConnector
from kvbeam.integrations.vllm.scheduler import Load
from kvbeam.integrations.vllm.worker import WorkerSide

log = logging.getLogger(__name__)

#: Transfers whose first landed block is zeroed (the test's kvbeam ids ``zero-N``).
ZERO_PREFIX = "zero-"


class ZeroingWorkerSide(WorkerSide):
    """The connector's worker side, zeroing the first landed block of ``zero-`` transfers."""

    def _landed(self, load: Load, receiver: Receiver) -> None:
        if load.kvbeam_id.startswith(ZERO_PREFIX) and load.block_ids:
            for view in self._views:
                view[load.block_ids[0]].zero_()
            log.warning("negative control: zeroed block %d of request %s (transfer %s)",
                        load.block_ids[0], load.req_id, load.kvbeam_id)
        super()._landed(load, receiver)


class ZeroingConnector(KvbeamConnector):
    """:class:`KvbeamConnector` whose worker side is a :class:`ZeroingWorkerSide`."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        plain = self.worker
        if plain is not None:  # nothing attached yet: register_kv_caches comes later
            self.worker = ZeroingWorkerSide(plain.settings, plain.block_size,
                                            plain.num_kv_heads, plain.head_size)
            plain.close()
