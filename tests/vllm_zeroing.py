"""The negative control of tests/host/test_vllm_connector.py, inside the test harness only.

:class:`ZeroingConnector` is the kvbeam connector with one difference: once a transfer
whose kvbeam id starts with :data:`ZERO_PREFIX` landed, its worker zeroes the request's
first block in every layer (before releasing the reservation, as vLLM takes the KV
over); with :data:`LAYER_PREFIX`, every block of the request in one layer (one layer's
piece of a request sent layer by layer). Staged (tests/host/test_vllm_staged.py), it
zeroes that block's staging item in every layer instead, after the landing and before
the scatter into vLLM's blocks. The decode instance of the test loads it with
``kv_connector_module_path`` ``tests.vllm_zeroing``; nothing in kvbeam names this
module, so no request parameter, setting or variable of a production deployment can
turn the zeroing on.
"""

from __future__ import annotations

import logging

from kvbeam.engine import Receiver
from kvbeam.engine.staging import Staged
from kvbeam.integrations.vllm.connector import KvbeamConnector
from kvbeam.integrations.vllm.scheduler import Load
from kvbeam.integrations.vllm.worker import KV, WorkerSide

log = logging.getLogger(__name__)

#: Transfers whose first landed block is zeroed (the test's kvbeam ids ``zero-N``).
ZERO_PREFIX = "zero-"
#: Transfers whose every landed block is zeroed in one layer, the model's middle one:
#: one layer's piece of a request sent layer by layer (kvbeam ids ``zlayer-N``).
LAYER_PREFIX = "zlayer-"


class ZeroingWorkerSide(WorkerSide):
    """The connector's worker side, zeroing the first landed block of ``zero-`` transfers."""

    def _before_scatter(self, load: Load, landing: Staged) -> None:
        if load.kvbeam_id.startswith(ZERO_PREFIX) and load.block_ids:
            assert self.staging is not None
            item = int(landing.lists[KV][0])
            for buf in self.staging.layout.flat_buffers:
                self.staging.pools.buffer_view(buf).view(-1, buf.item_len)[item].zero_()
            log.warning("negative control: zeroed the staging item %d of block %d of request "
                        "%s (transfer %s) before the scatter", item, load.block_ids[0],
                        load.req_id, load.kvbeam_id)

    def _landed(self, load: Load, receiver: Receiver) -> None:
        if load.kvbeam_id.startswith(ZERO_PREFIX) and load.block_ids and self.staging is None:
            for view in self._views:
                view[load.block_ids[0]].zero_()
            log.warning("negative control: zeroed block %d of request %s (transfer %s)",
                        load.block_ids[0], load.req_id, load.kvbeam_id)
        if load.kvbeam_id.startswith(LAYER_PREFIX) and load.block_ids and self.staging is None:
            layer = len(self._views) // 2
            self._views[layer][list(load.block_ids)] = 0
            log.warning("negative control: zeroed layer %d of the %d blocks of request %s "
                        "(transfer %s)", layer, len(load.block_ids), load.req_id,
                        load.kvbeam_id)
        super()._landed(load, receiver)


class ZeroingConnector(KvbeamConnector):
    """:class:`KvbeamConnector` whose worker side is a :class:`ZeroingWorkerSide`."""

    worker_class = ZeroingWorkerSide
